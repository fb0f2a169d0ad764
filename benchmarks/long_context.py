"""Long-context fwd+bwd on one GPU: time and peak memory at growing seqlen (memory must be linear).

    python benchmarks/long_context.py --out benchmarks/results/
Writes long_context_<gpu>_<date>.json. Acceptance shape: b=1, s=131072, h=16, d=128, bf16.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import pathlib

import torch
import triton

import ioattn


def run(s: int, causal: bool, h: int = 16, d: int = 128) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16)
    inputs_bytes = torch.cuda.memory_allocated()
    # an untimed run at the full size compiles the kernels (configs depend on the length)
    ioattn.flash_attn_func(q, k, v, causal=causal).backward(dout)
    q.grad = k.grad = v.grad = None
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    out = ioattn.flash_attn_func(q, k, v, causal=causal)
    mid.record()
    out.backward(dout)
    end.record()
    torch.cuda.synchronize()
    flops = 4 * s * s * h * d / (2 if causal else 1)
    fwd_ms, bwd_ms = start.elapsed_time(mid), mid.elapsed_time(end)
    finite = all(torch.isfinite(t).all().item() for t in (out, q.grad, k.grad, v.grad))
    return dict(b=1, s=s, h=h, d=d, causal=causal, dtype="bf16", fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                fwd_tflops=flops / fwd_ms * 1e-9, bwd_tflops=2.5 * flops / bwd_ms * 1e-9,
                peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
                inputs_and_dout_gib=inputs_bytes / 2**30,
                peak_over_inputs=torch.cuda.max_memory_allocated() / inputs_bytes, all_finite=finite)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--seqlens", default="16384,32768,65536,131072")
    a = ap.parse_args()
    rows = []
    for causal in (True, False):
        for s in map(int, a.seqlens.split(",")):
            r = run(s, causal)
            rows.append(r)
            print(f"s={s:6d} causal={causal!s:5} fwd {r['fwd_ms']:8.1f} ms {r['fwd_tflops']:5.0f} TFLOP/s  "
                  f"bwd {r['bwd_ms']:8.1f} ms {r['bwd_tflops']:5.0f} TFLOP/s  peak {r['peak_mem_gib']:.2f} GiB "
                  f"({r['peak_over_inputs']:.2f}x inputs) finite={r['all_finite']}", flush=True)
    props = torch.cuda.get_device_properties(0)
    doc = dict(env=dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__,
                        date=dt.datetime.now(dt.timezone.utc).isoformat()),
               method="one fwd + one bwd per row, CUDA events, after a small warm-up; peak = "
                      "torch.cuda.max_memory_allocated (inputs, dout, outputs, grads, LSE)",
               rows=rows)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = props.name.lower().replace(" ", "-")
    path = out / f"long_context_{slug}_{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(path)


if __name__ == "__main__":
    main()

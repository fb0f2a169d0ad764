"""Where a dense call's GPU time goes, kernel by kernel: ioattn's forward / backward and SDPA
cuDNN's on the same FA-grid cells (16k tokens, hidden 2048), each call profiled with
torch.profiler's CUDA activity. Per implementation, mode and cell: every kernel's mean time a
call and its share, the main kernel's own TFLOP/s (FA's FLOP formula over the kernel's time
alone), and the GPU time a call in all. The question it answers: how much of a short cell's
gap to cuDNN is side passes (the backward's delta preprocess, the fp32 dQ buffer's zeroing and
conversion) and how much the main kernel, at 2k against 16k.

    python benchmarks/kernel_parts.py --dims 64,128 --seqlens 2048,4096,16384 --json parts.json
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import ioattn
from ioattn.bench.runner import collect_env


def _flops(mode: str, b: int, h: int, s: int, d: int, causal: bool) -> float:
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f * (2.5 if mode == "bwd" else 1.0)


def _calls(impl: str, mode: str, q, k, v, dout, causal: bool):
    """(setup, timed) callables: the timed one is the profiled call (the forward, or a backward
    through a graph the setup built)."""
    if impl == "ioattn":
        def fwd():
            return ioattn.flash_attn_func(q, k, v, causal=causal)
    else:
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    if mode == "fwd":
        return (lambda: None), fwd
    state = {}

    def setup():
        for x in (q, k, v):
            x.grad = None
        state["out"] = fwd()

    def bwd():
        state["out"].backward(dout)
    return setup, bwd


def measure(impl: str, mode: str, d: int, s: int, causal: bool, dtype, reps: int) -> dict:
    b, h = max(1, 16384 // s), 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=mode == "bwd")
               for _ in range(3))
    dout = torch.randn_like(q)
    setup, call = _calls(impl, mode, q, k, v, dout, causal)
    for _ in range(2):  # compile, warm up
        setup()
        call()
    torch.cuda.synchronize()
    per = defaultdict(float)
    count = defaultdict(int)
    for _ in range(reps):
        setup()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name] += e.time_range.elapsed_us() / reps  # kernels, memsets, copies
                count[e.name] += 1
    total = sum(per.values())
    main_name = max(per, key=per.get)
    flops = _flops(mode, b, h, s, d, causal)
    kernels = sorted(({"name": n[:120], "us": round(t, 2), "share": round(t / total, 4),
                       "launches": count[n] // reps} for n, t in per.items()),
                     key=lambda r: -r["us"])
    return dict(impl=impl, mode=mode, d=d, s=s, b=b, h=h, causal=causal,
                gpu_us=round(total, 2), tflops_gpu=round(flops / total / 1e6, 1),
                main_kernel=main_name[:120], main_us=round(per[main_name], 2),
                tflops_main=round(flops / per[main_name] / 1e6, 1), kernels=kernels)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlens", default="2048,4096,16384")
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--impls", default="ioattn,sdpa_cudnn")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    rows = []
    for d in (int(x) for x in a.dims.split(",")):
        for s in (int(x) for x in a.seqlens.split(",")):
            for causal in (False, True):
                for mode in a.modes.split(","):
                    for impl in a.impls.split(","):
                        r = measure(impl, mode, d, s, causal, dtype, a.reps)
                        rows.append(r)
                        side = ", ".join(f"{k['name'][:40]} {k['us']:.0f}" for k in r["kernels"][1:4])
                        print(f"{mode} d{d} s{s} {'C' if causal else 'N'} {impl:10s} "
                              f"gpu {r['gpu_us']:8.1f} us ({r['tflops_gpu']:5.1f}) main "
                              f"{r['main_us']:8.1f} us ({r['tflops_main']:5.1f})  | {side}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(env=collect_env(torch.device("cuda")), args=vars(a), rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()

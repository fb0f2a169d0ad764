"""One dense forward (or forward + backward) call on an FA-grid shape (16k tokens, hidden 2048),
for profilers: run it under ``ncu`` to read the tensor-pipe utilization and the warp stall reasons
of a kernel, e.g.

    ncu --clock-control none -k regex:attn_fwd_sm90 --launch-skip 2 --launch-count 1 \\
        --set full -o fwd python benchmarks/profile_fwd.py --d 128 --seqlen 8192

(the first two calls compile and warm up; the third is the one profiled; ``--backward`` adds
the backward to each call: profile ``regex:bwd_dkdv_sm90`` then)."""
from __future__ import annotations

import argparse

import torch

import ioattn
from ioattn.bench.anchors import IMPLS, make_inputs
from ioattn.bench.shapes import fa_grid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backend", default="sm90",
                    help="ioattn's backend, or 'sdpa_cudnn': SDPA's cuDNN backend on [b, h, s, d] "
                    "tensors, as the benchmark builds it (ioattn.bench.anchors)")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    a = ap.parse_args()
    if a.backend == "sdpa_cudnn":
        shape = fa_grid(dims=[a.d], seqlens=[a.seqlen], causals=[a.causal], dtypes=[a.dtype],
                        modes=["bwd" if a.backward else "fwd"])[0]
        built = IMPLS["sdpa_cudnn"].build(make_inputs(shape, torch.device("cuda")), shape)
        call, dout = built.forward, built.dout
    else:
        b, h = max(1, 16384 // a.seqlen), 2048 // a.d
        dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
        q, k, v = (torch.randn(b, a.seqlen, h, a.d, device="cuda", dtype=dtype,
                               requires_grad=a.backward) for _ in range(3))
        dout = torch.randn_like(q)

        def call():
            return ioattn.flash_attn_func(q, k, v, causal=a.causal, backend=a.backend)

    for i in range(a.calls):
        if i == a.calls - 1:  # the last call between cudaProfilerStart / Stop (process-wide,
            # so the backward's kernels, launched from autograd's device thread, are in too):
            # ncu --profile-from-start off profiles just that call
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        out = call()
        if a.backward:
            out.backward(dout)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()

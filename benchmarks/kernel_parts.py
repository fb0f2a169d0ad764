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
from torch.profiler import ProfilerActivity, profile

from ioattn.bench.anchors import IMPLS, make_inputs
from ioattn.bench.runner import collect_env
from ioattn.bench.shapes import Shape, fa_grid


def _calls(impl: str, shape: Shape):
    """(setup, timed) callables on the cell's data, the implementation built as the benchmark
    builds it (``ioattn.bench.anchors.IMPLS``): the timed one is the forward, or a backward
    through the graph the setup's forward built."""
    built = IMPLS[impl].build(make_inputs(shape, torch.device("cuda")), shape)
    if shape.mode == "fwd":
        return (lambda: None), built.forward
    state = {}

    def setup():
        for x in built.leaves:
            x.grad = None
        state["out"] = built.forward()

    return setup, lambda: state["out"].backward(built.dout)


def measure(impl: str, shape: Shape, reps: int) -> dict:
    setup, call = _calls(impl, shape)
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
    flops = shape.flops()
    kernels = sorted(({"name": n[:120], "us": round(t, 2), "share": round(t / total, 4),
                       "launches": count[n] // reps} for n, t in per.items()),
                     key=lambda r: -r["us"])
    return dict(impl=impl, mode=shape.mode, d=shape.d, s=shape.s, b=shape.b, h=shape.h,
                causal=shape.causal, gpu_us=round(total, 2),
                tflops_gpu=round(flops / total / 1e6, 1), main_kernel=main_name[:120],
                main_us=round(per[main_name], 2),
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
    rows = []
    for shape in fa_grid(dims=[int(x) for x in a.dims.split(",")],
                         seqlens=[int(x) for x in a.seqlens.split(",")], dtypes=(a.dtype,),
                         modes=a.modes.split(",")):
        for impl in a.impls.split(","):
            r = measure(impl, shape, a.reps)
            rows.append(r)
            side = ", ".join(f"{k['name'][:40]} {k['us']:.0f}" for k in r["kernels"][1:4])
            print(f"{shape.label()} {impl:10s} gpu {r['gpu_us']:8.1f} us ({r['tflops_gpu']:5.1f}) "
                  f"main {r['main_us']:8.1f} us ({r['tflops_main']:5.1f})  | {side}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(env=collect_env(torch.device("cuda")), args=vars(a), rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()

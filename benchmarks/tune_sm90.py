"""Sweep the sm90 (Gluon) kernels' pipeline depths on the H200, FA-grid shapes (16k tokens,
hidden 2048): the backward's dK/dV and dQ kernels' Q/dO and K/V ring stages, and the d=64
three-warpgroup forward's K/V stages. Every config compiles spill-free or with the spills of the
default (CPU compile for sm90, benchmarks/NOTES.md). Prints TFLOP/s per config (FA's FLOP
formula) and the best per shape.
    python benchmarks/tune_sm90.py --mode bwd --dims 64,128 --seqlens 2048,16384
    python benchmarks/tune_sm90.py --mode fwd --dims 64 --stages-fwd 4,6,8"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

import ioattn
from ioattn.dense import sm90_bwd, sm90_fwd
from tune_decode import timed_row  # (run as a script: benchmarks/ is on sys.path)


def _shape(s: int, d: int):
    return 16384 // s, s, 2048 // d, d


def _flops(b, s, h, d, causal, mode):
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f * (2.5 if mode == "bwd" else 1.0)


def run(mode, dims, seqlens, configs):
    rows = []
    orig = (sm90_bwd.DKDV_STAGES, sm90_bwd.DQ_STAGES, sm90_fwd._tile)
    for d, s, causal in itertools.product(dims, seqlens, (False, True)):
        b, s, h, d = _shape(s, d)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=mode == "bwd") for _ in range(3))
        for cfg in configs:
            row = dict(mode=mode, d=d, s=s, causal=causal, config=cfg)
            if mode == "bwd":
                sm90_bwd.DKDV_STAGES, sm90_bwd.DQ_STAGES = cfg
            else:
                sm90_fwd._tile = (lambda hd, wgs, st=cfg[0], t=orig[2]:
                                  (64, st, 160) if wgs == 3 else t(hd, wgs))

            def make():
                if mode == "fwd":
                    return lambda: ioattn.flash_attn_func(q, k, v, causal=causal, backend="sm90")
                out = ioattn.flash_attn_func(q, k, v, causal=causal, backend="sm90")
                g = torch.randn_like(out)
                return lambda: out.backward(g, retain_graph=True)
            timed_row(row, make, rows, _flops(b, s, h, d, causal, mode), "tflops", rep=50,
                      grad_to_none=[q, k, v] if mode == "bwd" else None)
    sm90_bwd.DKDV_STAGES, sm90_bwd.DQ_STAGES, sm90_fwd._tile = orig
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="bwd", choices=("bwd", "fwd"))
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlens", default="2048,16384")
    ap.add_argument("--stages-dkdv", default="2,3,4")
    ap.add_argument("--stages-dq", default="2,3,4")
    ap.add_argument("--stages-fwd", default="4,6,8", help="d=64 three-warpgroup forward")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    ints = lambda x: [int(v) for v in x.split(",")]  # noqa: E731
    if a.mode == "bwd":
        configs = list(itertools.product(ints(a.stages_dkdv), ints(a.stages_dq)))
    else:
        configs = [(st,) for st in ints(a.stages_fwd)]
    rows = run(a.mode, ints(a.dims), ints(a.seqlens), configs)
    for key in sorted({(r["d"], r["s"], r["causal"]) for r in rows}):
        ok = sorted((r for r in rows if (r["d"], r["s"], r["causal"]) == key and "tflops" in r),
                    key=lambda r: -r["tflops"])
        print("== best", key, [(r["config"], round(r["tflops"], 1)) for r in ok[:4]])
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()

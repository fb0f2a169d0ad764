"""Sweep of the paged decode kernel's launch choices on the GPU (K/V tile keys, warps, pipeline
stages, work items per SM), on the decode acceptance cells; prints TB/s per config and the best.
    python benchmarks/tune_decode.py [--json out.json]"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.testing import do_bench

import ioattn.flashinfer as fi
from ioattn.decode import triton_decode
from ioattn.paged import plan

CELLS = [(64, 4096, 16), (16, 8192, 16), (1, 32768, 16), (128, 2048, 16), (64, 4096, 1)]


def run(cells, configs, h=32, h_k=8, d=128, dtype=torch.bfloat16):
    results = []
    orig = (triton_decode._tile_n, triton_decode._attn_warps, triton_decode._attn_stages,
            plan.target_items)
    for b, ctx, page in cells:
        n_pages = b * (-(-ctx // page))
        cache = torch.randn(n_pages, 2, page, h_k, d, device="cuda", dtype=dtype)
        indptr = torch.arange(0, n_pages + 1, n_pages // b, dtype=torch.int32)
        indices = torch.randperm(n_pages, dtype=torch.int32).cuda()
        last = torch.full((b,), ctx - (ctx // page - 1) * page if ctx % page == 0 else ctx % page,
                          dtype=torch.int32)
        q = torch.randn(b, h, d, device="cuda", dtype=dtype)
        out = torch.empty_like(q)
        nbytes = 2 * b * ctx * h_k * d * 2
        for bn, warps, stages, per_sm in configs:
            triton_decode._tile_n = lambda bm, bd, bn=bn: bn
            triton_decode._attn_warps = lambda bm, bd, x, w=warps: w
            triton_decode._attn_stages = lambda g, bm, s=stages: s
            plan.target_items = (lambda batch, n_heads_k, sms, k=per_sm:
                                 max(batch, -(-k * sms // max(n_heads_k, 1))))
            w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8,
                                                                  device="cuda"))
            row = dict(b=b, ctx=ctx, page=page, block_n=bn, warps=warps, stages=stages, per_sm=per_sm)
            try:
                w.plan(indptr, indices, last, h, h_k, d, page, q_data_type=dtype)
                ms = do_bench(lambda: w.run(q, cache, out=out), warmup=10, rep=40, return_mode="median")
                row.update(ms=ms, tb_s=nbytes / ms * 1e-9)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            results.append(row)
            print(json.dumps(row), flush=True)
    (triton_decode._tile_n, triton_decode._attn_warps, triton_decode._attn_stages,
     plan.target_items) = orig
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--per-sm", default="2,4")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    configs = list(itertools.product(ints(a.block_n), ints(a.warps), ints(a.stages), ints(a.per_sm)))
    res = run(CELLS, configs)
    ok = [r for r in res if "tb_s" in r]
    for cell in CELLS:
        rows = sorted((r for r in ok if (r["b"], r["ctx"], r["page"]) == cell), key=lambda r: -r["tb_s"])
        print("== best", cell, [(r["block_n"], r["warps"], r["stages"], r["per_sm"], round(r["tb_s"], 2))
                                for r in rows[:4]])
    keys = {(r["block_n"], r["warps"], r["stages"], r["per_sm"]) for r in ok}
    geo = {}
    for k in keys:
        vals = [r["tb_s"] for r in ok if (r["block_n"], r["warps"], r["stages"], r["per_sm"]) == k]
        if len(vals) == len(CELLS):
            p = 1.0
            for v in vals:
                p *= v
            geo[k] = p ** (1 / len(vals))
    for k, v in sorted(geo.items(), key=lambda kv: -kv[1])[:6]:
        print("== geomean", k, round(v, 3))
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()

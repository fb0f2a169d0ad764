"""Sweep of the paged decode kernel's launch choices on the GPU (K/V tile keys, warps, pipeline
stages, work items per SM), on the decode acceptance cells; prints TB/s per config and the best.
    python benchmarks/tune_decode.py [--json out.json]
    python benchmarks/tune_decode.py --prefill   (chunked-prefill tiles, vs the dense forward)
    python benchmarks/tune_decode.py --profile   (kernel and host microseconds per decode cell)
    python benchmarks/tune_decode.py --fp8       (an fp8 e4m3 cache; TB/s of fp8 bytes)
    python benchmarks/tune_decode.py --graph     (time CUDA-graph replays of run(): kernel speed
                                                  without host time, which bounds the small cells)
    python benchmarks/tune_decode.py --sm90 --block-n 32,64,128 --stages 2,3,4,6 --per-sm 1,2,4
                                                 (the sm90 decode kernel's ring, graph replays)
    python benchmarks/tune_decode.py --sm90 --per-sm auto --grid-extra auto,0,16,64
                                                 (the grid's CTAs past the plan's items)
    python benchmarks/tune_decode.py --kvcache --splits 0,1,2,3,4
                                                 (flash_attn_with_kvcache's decode split count)"""
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


def _replayed(fn, calls: int = 1):
    """fn captured ``calls`` times in a CUDA graph (after an eager warm-up call); returns the
    replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def timed_row(row: dict, make, results: list, rate: float, unit: str, **bench) -> None:
    """Time the callable ``make()`` builds (do_bench median) into row as ms and ``unit`` = rate /
    ms * 1e-9 (rate: bytes or FLOPs per call), or the error building or timing it raised (a
    config that does not compile or fit is reported, not fatal); append the row to results and
    print it."""
    try:
        ms = do_bench(make(), **{"warmup": 10, "rep": 40, "return_mode": "median", **bench})
        row.update(ms=ms, **{unit: rate / ms * 1e-9})
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
    results.append(row)
    print(json.dumps(row), flush=True)


_SPLIT_TARGETS = plan.split_targets


def _items_per_sm(k):
    """plan.split_targets fixed at k work items per SM (over the KV heads; 0: the batch, no
    split of equal requests), or left as it is for k = None ("auto": the plan's own choice)."""
    if k is None:
        return _SPLIT_TARGETS
    return lambda batch, n_heads_k, sms: [max(batch, -(-k * sms // max(n_heads_k, 1)))]


def _wrapper(indices, graph: bool):
    return fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=graph,
        paged_kv_indices_buffer=torch.empty_like(indices) if graph else None)


def decode_cell(b, ctx, page, h=32, h_k=8, d=128, dtype=torch.bfloat16):
    """One decode cell's data: a random paged cache [pages, 2, page, h_k, d] in shuffled page
    order, its CSR table (indptr, indices, last_page_len), q [b, h, d], an output buffer and the
    K+V bytes a call reads."""
    n_pages = b * (-(-ctx // page))
    cache = torch.randn(n_pages, 2, page, h_k, d, device="cuda", dtype=dtype)
    indptr = torch.arange(0, n_pages + 1, n_pages // b, dtype=torch.int32)
    indices = torch.randperm(n_pages, dtype=torch.int32).cuda()
    last = torch.full((b,), page if ctx % page == 0 else ctx % page, dtype=torch.int32)
    q = torch.randn(b, h, d, device="cuda", dtype=dtype)
    nbytes = 2 * b * ctx * h_k * d * cache.element_size()
    return cache, indptr, indices, last, q, torch.empty_like(q), nbytes


def run(cells, configs, h=32, h_k=8, d=128, dtype=torch.bfloat16, kv_dtype=None, graph=False):
    results = []
    orig = (triton_decode._tile_n, triton_decode._attn_warps, triton_decode._attn_stages,
            triton_decode._worklist_stages, triton_decode.worklist_launch, plan.split_targets)
    for b, ctx, page in cells:
        cache, indptr, indices, last, q, out, nbytes = decode_cell(b, ctx, page, h, h_k, d, dtype)
        if kv_dtype is not None:
            cache = cache.to(kv_dtype)
            nbytes = nbytes * cache.element_size() // 2
        scales = dict(k_scale=1.0, v_scale=1.0) if kv_dtype is not None else {}
        for bn, warps, stages, per_sm in configs:
            triton_decode._tile_n = lambda bm, bd, bn=bn: bn
            triton_decode._attn_warps = lambda bm, bd, x, w=warps: w
            triton_decode._attn_stages = lambda g, bm, s=stages: s
            triton_decode._worklist_stages = lambda g, bm, fp8, dec=True, page=16, s=stages: s
            triton_decode.worklist_launch = lambda bm, bd, fp8, x, bn=bn, w=warps: (bn, w)
            plan.split_targets = _items_per_sm(per_sm)
            w = _wrapper(indices, graph)
            row = dict(b=b, ctx=ctx, page=page, block_n=bn, warps=warps, stages=stages, per_sm=per_sm,
                       graph=graph)

            def make(w=w):
                w.plan(indptr, indices, last, h, h_k, d, page, q_data_type=dtype,
                       kv_data_type=kv_dtype or dtype)
                call = lambda: w.run(q, cache, out=out, **scales)  # noqa: E731
                return _replayed(call) if graph else call
            timed_row(row, make, results, nbytes, "tb_s")
    (triton_decode._tile_n, triton_decode._attn_warps, triton_decode._attn_stages,
     triton_decode._worklist_stages, triton_decode.worklist_launch, plan.split_targets) = orig
    return results


def run_sm90(cells, configs, h=32, h_k=8, d=128, dtype=torch.bfloat16):
    """The sm90 decode kernel (``ioattn.decode.sm90_decode``) per (keys per tile, ring stages,
    work items per SM, grid bound), timed as CUDA-graph replays of run() (a graph-mode wrapper
    always takes it). Configs whose ring does not fit two CTAs' or one CTA's shared memory still
    run (one CTA per SM); the row says how many fit. The grid bound (``--grid-extra``): None,
    the plan's ``max_work_items``; an int e, the plan's own items plus e (the grid a captured
    graph launches has that many items). On a grid larger than the work whose units fit one
    an SM the CTAs claim their units (``sm90_decode.CLAIM``); else those past the plan's
    items exit at once. e = 0 never claims."""
    from ioattn.decode import sm90_decode

    results = []
    orig = (sm90_decode.BLOCK_N, sm90_decode.STAGES, plan.split_targets, fi.max_work_items)
    try:
        for b, ctx, page in cells:
            cache, indptr, indices, last, q, out, nbytes = decode_cell(b, ctx, page, h, h_k, d, dtype)
            for bn, stages, per_sm, extra in configs:
                smem = stages * 2 * bn * d * cache.element_size() + 64 * d * cache.element_size()
                row = dict(b=b, ctx=ctx, page=page, block_n=bn, stages=stages, per_sm=per_sm,
                           grid_extra=extra, smem_kb=smem // 1024,
                           ctas_per_sm=(228 << 10) // (smem + 2048), graph=True)
                if smem > 227 << 10 or page % 8 or (bn % page and page % bn):
                    continue
                sm90_decode.BLOCK_N, sm90_decode.STAGES = bn, stages
                plan.split_targets = _items_per_sm(per_sm)
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                items = len(plan.split_work([ctx] * b, h_k, sms).work)
                fi.max_work_items = orig[3] if extra is None else (lambda *_, n=items + extra: n)
                grid = fi.max_work_items(b, h_k, sms)
                row.update(ctas=items * h_k, grid_ctas=grid * h_k)
                w = _wrapper(indices, True)

                def make(w=w):
                    w.plan(indptr, indices, last, h, h_k, d, page, q_data_type=dtype)
                    return _replayed(lambda: w.run(q, cache, out=out))
                timed_row(row, make, results, nbytes, "tb_s")
    finally:
        sm90_decode.BLOCK_N, sm90_decode.STAGES, plan.split_targets, fi.max_work_items = orig
    return results


def run_prefill(configs, b=8, ctx=4096, new=512, page=16, h=32, h_k=8, d=128, dtype=torch.bfloat16):
    """Chunked prefill through flash_attn_with_kvcache (the bench's cell) per paged-tile config
    (rows, keys, warps, stages), next to the dense forward on the same data."""
    import ioattn

    total = ctx + new
    n_pages = b * (-(-total // page))
    cache = torch.randn(n_pages, 2, page, h_k, d, device="cuda", dtype=dtype)
    table = torch.randperm(n_pages, dtype=torch.int32).cuda().view(b, -1)
    q = torch.randn(b, new, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, total, h_k, d, device="cuda", dtype=dtype)
    v = torch.randn(b, total, h_k, d, device="cuda", dtype=dtype)
    lens = torch.full((b,), total, dtype=torch.int32, device="cuda")
    flops = 4.0 * b * h * d * sum(ctx + i + 1 for i in range(new))
    # the same keys in the pages (token t of sequence i in page table[i, t // page])
    cache[table.long().flatten(), 0] = k.view(b, -1, page, h_k, d).flatten(0, 1)
    cache[table.long().flatten(), 1] = v.view(b, -1, page, h_k, d).flatten(0, 1)
    ref = ioattn.flash_attn_func(q, k, v, causal=True).float()
    ms = do_bench(lambda: ioattn.flash_attn_func(q, k, v, causal=True), warmup=10, rep=40,
                  return_mode="median")
    results = [dict(impl="dense", ms=ms, tflops=flops / ms * 1e-9)]
    print(json.dumps(results[0]), flush=True)
    orig = (triton_decode.paged_tiles, triton_decode._attn_warps, triton_decode._attn_stages)
    for bm, bn, warps, stages in configs:
        triton_decode.paged_tiles = lambda group, dd, rows=1, bm=bm, bn=bn: (bm, 128, bn)
        triton_decode._attn_warps = lambda m, bd, x, w=warps: w
        triton_decode._attn_stages = lambda g, m, s=stages: s
        row = dict(impl="kvcache", block_m=bm, block_n=bn, warps=warps, stages=stages)

        def make(row=row):
            fn = lambda: ioattn.flash_attn_with_kvcache(q, cache[:, 0], cache[:, 1],  # noqa: E731
                                                       cache_seqlens=lens, block_table=table,
                                                       causal=True)
            row["max_abs_err"] = (fn().float() - ref).abs().max().item()
            return fn
        timed_row(row, make, results, flops, "tflops")
    triton_decode.paged_tiles, triton_decode._attn_warps, triton_decode._attn_stages = orig
    return results


def run_kvcache(cells, splits, h=32, h_k=8, d=128, dtype=torch.bfloat16):
    """flash_attn_with_kvcache's decode (one query a request, the portable split-KV kernel) over
    the cell's pages through a block table, per num_splits (0: its own choice,
    ``triton_decode.num_splits_for``), eager and as CUDA-graph replays; the row says which split
    the launch makes and how many programs (splits x row blocks x KV heads x requests)."""
    import ioattn

    results = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for b, ctx, page in cells:
        cache, indptr, indices, last, q, out, nbytes = decode_cell(b, ctx, page, h, h_k, d, dtype)
        table = indices.view(b, -1)  # (decode_cell: the same page count per request)
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        for n in splits:
            # (the split kvcache_attn makes of it: 0 picked, any count rounded to whole tiles)
            *_, m_blocks, _, made = triton_decode.kvcache_launch(b, 1, h, h_k, d, ctx, False, n,
                                                                 q.device)
            for graph in (False, True):
                row = dict(b=b, ctx=ctx, page=page, num_splits=n, splits_made=made, sms=sms,
                           programs=made * m_blocks * h_k * b, graph=graph)

                def make(n=n, graph=graph):
                    call = lambda: ioattn.flash_attn_with_kvcache(  # noqa: E731
                        q[:, None], cache[:, 0], cache[:, 1], cache_seqlens=lens,
                        block_table=table, num_splits=n)
                    return _replayed(call) if graph else call
                timed_row(row, make, results, nbytes, "tb_s")
    return results


def profile_cell(b, ctx, page, h=32, h_k=8, d=128, dtype=torch.bfloat16):
    """Kernel times (torch.profiler) and host time per run() of one decode cell."""
    import time

    cache, indptr, indices, last, q, out, _ = decode_cell(b, ctx, page, h, h_k, d, dtype)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, last, h, h_k, d, page, q_data_type=dtype)
    for _ in range(20):
        w.run(q, cache, out=out)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        w.run(q, cache, out=out)
    host_us = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            w.run(q, cache, out=out)
        torch.cuda.synchronize()
    kernels = {e.key: round(e.device_time_total / e.count, 2) for e in prof.key_averages()
               if e.device_time_total > 0}
    row = dict(b=b, ctx=ctx, page=page, host_us_per_run=round(host_us, 2), kernel_us=kernels)
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--per-sm", default="auto,2,4",
                    help="work items per SM over the KV heads (0: no split; auto: the plan's rule)")
    ap.add_argument("--prefill", action="store_true", help="sweep the chunked-prefill tiles instead")
    ap.add_argument("--profile", action="store_true", help="kernel and host times of each cell")
    ap.add_argument("--fp8", action="store_true", help="an fp8 (e4m3) cache")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays of run()")
    ap.add_argument("--sm90", action="store_true",
                    help="sweep the sm90 decode kernel's tile keys (--block-n), ring stages "
                         "(--stages) and items per SM (--per-sm), as graph replays")
    ap.add_argument("--grid-extra", default="auto",
                    help="(--sm90) grid bounds: the plan's own items plus these many (auto: the "
                         "plan's max_work_items)")
    ap.add_argument("--kvcache", action="store_true",
                    help="sweep flash_attn_with_kvcache's decode split count (--splits; 0: auto)")
    ap.add_argument("--splits", default="0,1,2,3,4,6,8")
    ap.add_argument("--cells", default=None, help="b x ctx x page, e.g. 1x32768x16 (default: all)")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    # lists that take "auto" (None: the library's own choice)
    auto_ints = lambda s: [None if x == "auto" else int(x) for x in s.split(",")]  # noqa: E731
    per_sm = auto_ints(a.per_sm)
    if a.profile:
        res = [profile_cell(*cell) for cell in CELLS]
        if a.json:
            json.dump(res, open(a.json, "w"), indent=1)
        return
    if a.prefill:
        configs = list(itertools.product((64, 128), ints(a.block_n), ints(a.warps), (2, 3)))
        res = run_prefill(configs)
        ok = sorted((r for r in res if "tflops" in r and r["impl"] == "kvcache"), key=lambda r: -r["tflops"])
        print("== best prefill", [(r["block_m"], r["block_n"], r["warps"], r["stages"], round(r["tflops"], 1))
                                  for r in ok[:5]], "dense", round(res[0]["tflops"], 1))
        if a.json:
            json.dump(res, open(a.json, "w"), indent=1)
        return
    cells = ([tuple(int(x) for x in c.split("x")) for c in a.cells.split(",")] if a.cells
             else CELLS)
    if a.kvcache:
        res = run_kvcache(cells, ints(a.splits))
        for cell in cells:
            for graph in (False, True):
                rows = sorted((r for r in res if "tb_s" in r and r["graph"] == graph
                               and (r["b"], r["ctx"], r["page"]) == cell), key=lambda r: -r["tb_s"])
                print("== best kvcache", cell, "graph" if graph else "eager",
                      [(r["num_splits"], r["splits_made"], r["programs"], round(r["tb_s"], 2))
                       for r in rows])
        if a.json:
            json.dump(res, open(a.json, "w"), indent=1)
        return
    if a.sm90:
        res = run_sm90(cells, list(itertools.product(ints(a.block_n), ints(a.stages), per_sm,
                                                     auto_ints(a.grid_extra))))
        ok = [r for r in res if "tb_s" in r]
        for cell in cells:
            rows = sorted((r for r in ok if (r["b"], r["ctx"], r["page"]) == cell),
                          key=lambda r: -r["tb_s"])
            print("== best sm90", cell, [(r["block_n"], r["stages"], r["per_sm"], r["grid_extra"],
                                          r["ctas"], r["grid_ctas"], round(r["tb_s"], 2))
                                         for r in rows[:8]])
        if a.json:
            json.dump(res, open(a.json, "w"), indent=1)
        return
    configs = list(itertools.product(ints(a.block_n), ints(a.warps), ints(a.stages), per_sm))
    res = run(cells, configs, kv_dtype=torch.float8_e4m3fn if a.fp8 else None, graph=a.graph)
    ok = [r for r in res if "tb_s" in r]
    for cell in cells:
        rows = sorted((r for r in ok if (r["b"], r["ctx"], r["page"]) == cell), key=lambda r: -r["tb_s"])
        print("== best", cell, [(r["block_n"], r["warps"], r["stages"], r["per_sm"], round(r["tb_s"], 2))
                                for r in rows[:4]])
    keys = {(r["block_n"], r["warps"], r["stages"], r["per_sm"]) for r in ok}
    geo = {}
    for k in keys:
        vals = [r["tb_s"] for r in ok if (r["block_n"], r["warps"], r["stages"], r["per_sm"]) == k]
        if len(vals) == len(cells):
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

"""Decode benchmark (``python -m ioattn bench --suite decode``): one query token per request
against a paged KV cache, side by side in one process with SDPA (cuDNN, FLASH) on the same data
in contiguous form. Reported as effective K+V bytes read per second; plus chunked prefill (new
tokens onto a paged context) in TFLOP/s next to the dense forward on the same tokens.

Cells default to the serving acceptance shapes: GQA 32/8 query/KV heads, head dim 128, bf16.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ioattn.bench.runner import collect_env, time_ms

# (batch, context, page size)
DECODE_CELLS = [(64, 4096, 16), (16, 8192, 16), (1, 32768, 16), (128, 2048, 16), (64, 4096, 1)]
# (batch, context, new tokens, page size)
PREFILL_CELLS = [(8, 4096, 512, 16)]


def _paged_copy(k: torch.Tensor, v: torch.Tensor, page: int, g: torch.Generator):
    """Contiguous [b, s, h_k, d] K/V into a shuffled paged cache [pages, 2, page, h_k, d] with its
    CSR table and the equivalent dense block table."""
    b, s, h_k, d = k.shape
    per = s // page
    perm = torch.randperm(b * per, generator=g).to(k.device)
    cache = torch.empty(b * per, 2, page, h_k, d, device=k.device, dtype=k.dtype)
    cache[perm, 0] = k.reshape(b * per, page, h_k, d)
    cache[perm, 1] = v.reshape(b * per, page, h_k, d)
    table = perm.view(b, per).to(torch.int32)
    indptr = torch.arange(0, b * per + 1, per, dtype=torch.int32)
    last = torch.full((b,), page, dtype=torch.int32)
    return cache, table, indptr, table.flatten(), last


def _impls_decode(q, k, v, page, g) -> dict[str, Callable[[], torch.Tensor]]:
    import ioattn
    import ioattn.flashinfer as fi

    b, h, d = q.shape
    h_k = k.shape[2]
    cache, table, indptr, indices, last = _paged_copy(k, v, page, g)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=q.device))
    wrapper.plan(indptr, indices, last, h, h_k, d, page, q_data_type=q.dtype)  # not timed
    out = torch.empty_like(q)
    lens = torch.full((b,), k.shape[1], dtype=torch.int32, device=q.device)
    kc, vc = cache[:, 0], cache[:, 1]
    qt = q[:, :, None, :]  # [b, h, 1, d]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    # the same cache in fp8 (e4m3; FlashInfer's kv_data_type): half the bytes to read
    wrapper8 = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=q.device))
    wrapper8.plan(indptr, indices, last, h, h_k, d, page, q_data_type=q.dtype,
                  kv_data_type=torch.float8_e4m3fn)
    cache8 = cache.to(torch.float8_e4m3fn)
    q8 = q[:, None].to(torch.float8_e4m3fn)
    ones = torch.ones(b, h_k, device=q.device)
    fns = {
        "ioattn_paged": lambda: wrapper.run(q, cache, out=out),
        "ioattn_paged_fp8": lambda: wrapper8.run(q, cache8, k_scale=1.0, v_scale=1.0, out=out),
        "ioattn_kvcache": lambda: ioattn.flash_attn_with_kvcache(q[:, None], kc, vc, cache_seqlens=lens,
                                                                 block_table=table)[:, 0],
        # the fp8 pages under FlashAttention-3's fp8 call (q e4m3 too, per-head descales of 1)
        "ioattn_kvcache_fp8": lambda: ioattn.flash_attn_with_kvcache(
            q8, cache8[:, 0], cache8[:, 1], cache_seqlens=lens, block_table=table,
            q_descale=ones, k_descale=ones, v_descale=ones)[:, 0],
    }
    for name, backend in (("sdpa_cudnn", "CUDNN_ATTENTION"), ("sdpa_flash", "FLASH_ATTENTION")):
        def sdpa(backend=backend):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(getattr(SDPBackend, backend)):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)[:, :, 0]
        fns[name] = sdpa
    # as engines run decode: the call captured once in a CUDA graph and replayed (no host time)
    wrapper_g = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=q.device), use_cuda_graph=True,
        paged_kv_indices_buffer=torch.empty_like(indices))
    wrapper_g.plan(indptr, indices, last, h, h_k, d, page, q_data_type=q.dtype)
    out_g = torch.empty_like(q)
    fns["ioattn_paged_graph"] = _graphed(lambda: wrapper_g.run(q, cache, out=out_g))
    fns["sdpa_cudnn_graph"] = _graphed(fns["sdpa_cudnn"])
    # many calls captured in one CUDA graph, timed per call (``_graph_loop``: the anchors'
    # graph_us, as FlashInfer's and Triton's benchmarks time decode)
    fns["ioattn_paged_graphloop"] = _graph_loop(lambda: wrapper_g.run(q, cache, out=out_g))
    fns["sdpa_cudnn_graphloop"] = _graph_loop(fns["sdpa_cudnn"])
    # the same pages in FlashInfer's HND layout [pages, 2, h_k, page, d] (each head's page rows
    # contiguous), and the NHD cache with its pages in order (not shuffled): where the kernel's
    # time goes besides the bytes (DRAM locality of the reads)
    cache_hnd = cache.transpose(2, 3).contiguous()
    wrapper_h = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=q.device), kv_layout="HND",
        use_cuda_graph=True, paged_kv_indices_buffer=torch.empty_like(indices))
    wrapper_h.plan(indptr, indices, last, h, h_k, d, page, q_data_type=q.dtype)
    out_h = torch.empty_like(q)
    fns["ioattn_paged_hnd_graph"] = _graphed(lambda: wrapper_h.run(q, cache_hnd, out=out_h))
    cache_seq = cache[indices.long()]  # request by request, pages in order
    wrapper_s = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=q.device), use_cuda_graph=True,
        paged_kv_indices_buffer=torch.empty_like(indices))
    seq = torch.arange(indices.numel(), dtype=torch.int32, device=indices.device)
    wrapper_s.plan(indptr, seq, last, h, h_k, d, page, q_data_type=q.dtype)
    out_s = torch.empty_like(q)
    fns["ioattn_paged_inorder_graph"] = _graphed(lambda: wrapper_s.run(q, cache_seq, out=out_s))
    return fns


def _graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` captured in a CUDA graph at its first call (after one eager warm-up call), then
    replayed; the result tensor is the graph's output buffer."""
    state = {}

    def call():
        if "graph" not in state:
            if not torch.cuda.is_available():
                raise RuntimeError("needs CUDA")
            fn()
            torch.cuda.synchronize()
            state["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(state["graph"]):
                state["out"] = fn()
        state["graph"].replay()
        return state["out"]
    return call


def _graph_loop(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` as is, marked to be timed by ``triton.testing.do_bench_cudagraph``: N calls
    captured back to back in one CUDA graph, the graph replayed, its time / N (host launches
    amortized, no L2 flush between the calls)."""
    def call():
        if not torch.cuda.is_available():
            raise RuntimeError("needs CUDA")
        return fn()
    call.graph_loop = True
    return call


def _time_row(fn, device, warmup, rep) -> float:
    if getattr(fn, "graph_loop", False):
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return time_ms(fn, device, warmup, rep, [])


_NAMES = ("ioattn_paged", "ioattn_paged_fp8", "ioattn_kvcache", "ioattn_kvcache_fp8",
          "sdpa_cudnn", "sdpa_flash",
          "ioattn_paged_graph", "sdpa_cudnn_graph", "ioattn_paged_graphloop",
          "sdpa_cudnn_graphloop", "ioattn_paged_hnd_graph", "ioattn_paged_inorder_graph")


def run_decode(cells, device, warmup, rep, h=32, h_k=8, d=128, dtype=torch.bfloat16) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for b, ctx, page in cells:
        q = torch.randn(b, h, d, device=device, dtype=dtype)
        k = torch.randn(b, ctx, h_k, d, device=device, dtype=dtype)
        v = torch.randn(b, ctx, h_k, d, device=device, dtype=dtype)
        nbytes = 2 * b * ctx * h_k * d * k.element_size()
        # every row's max_abs_err is against attention on fp32 copies of the inputs (a bf16
        # anchor as the reference made the error of a correct kernel look like 0.05 on CPU)
        ref = F.scaled_dot_product_attention(q.float()[:, :, None], k.float().transpose(1, 2),
                                             v.float().transpose(1, 2), enable_gqa=True)[:, :, 0]
        for name, fn in _impls_decode(q, k, v, page, g).items():
            row = dict(kind="decode", b=b, ctx=ctx, page=page, h=h, h_k=h_k, d=d, impl=name)
            try:
                # a copy: rows that share an output buffer (out=) would all show the last one
                row["out"] = fn().clone()
                ms = _time_row(fn, device, warmup, rep)
                nb = nbytes // 2 if name.endswith("_fp8") else nbytes  # bytes this impl reads
                row.update(ms=ms, tb_s=nb / ms * 1e-9)
            except Exception as e:  # an anchor that cannot run this shape is reported, not fatal
                row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            rows.append(row)
        for row in rows[-len(_NAMES):]:
            o = row.pop("out", None)
            if o is not None:
                row["max_abs_err"] = (o.float() - ref).abs().max().item()
    return rows


def run_prefill(cells, device, warmup, rep, h=32, h_k=8, d=128, dtype=torch.bfloat16) -> list[dict]:
    import ioattn

    rows = []
    g = torch.Generator().manual_seed(1)
    for b, ctx, new, page in cells:
        total = ctx + new
        k = torch.randn(b, total, h_k, d, device=device, dtype=dtype)
        v = torch.randn(b, total, h_k, d, device=device, dtype=dtype)
        q = torch.randn(b, new, h, d, device=device, dtype=dtype)
        cache, table, *_ = _paged_copy(k, v, page, g)
        lens = torch.full((b,), total, dtype=torch.int32, device=device)
        flops = 4.0 * b * h * d * sum(ctx + i + 1 for i in range(new))
        def gather_dense():
            # a candidate design for long chunks: gather the pages into contiguous K/V (one copy,
            # amortized over the new tokens), then the dense forward
            kg = cache[table.long(), 0].flatten(1, 2)
            vg = cache[table.long(), 1].flatten(1, 2)
            return ioattn.flash_attn_func(q, kg, vg, causal=True)

        # the same pages as two contiguous pools (vLLM's layout: k_cache and v_cache tensors of
        # [pages, page, h_k, d]); FlashInfer's interleaved [pages, 2, ...] cache is not one
        k_pool, v_pool = cache[:, 0].contiguous(), cache[:, 1].contiguous()
        # FlashAttention's paged varlen call (vLLM's prefill): ragged queries, keys by block table
        cu_q = torch.arange(0, (b + 1) * new, new, dtype=torch.int32, device=device)
        cu_k = torch.arange(0, (b + 1) * total, total, dtype=torch.int32, device=device)
        q_flat = q.flatten(0, 1)
        fns = {
            "ioattn_varlen_paged": lambda: ioattn.flash_attn_varlen_func(
                q_flat, k_pool, v_pool, cu_q, cu_k, new, total, causal=True, block_table=table),
            "ioattn_kvcache": lambda: ioattn.flash_attn_with_kvcache(
                q, cache[:, 0], cache[:, 1], cache_seqlens=lens, block_table=table, causal=True),
            "ioattn_kvcache_pools": lambda: ioattn.flash_attn_with_kvcache(
                q, k_pool, v_pool, cache_seqlens=lens, block_table=table, causal=True),
            "gather_dense": gather_dense,
            "ioattn_dense": lambda: ioattn.flash_attn_func(q, k, v, causal=True),
        }
        for name, fn in fns.items():
            row = dict(kind="chunked_prefill", b=b, ctx=ctx, new=new, page=page, h=h, h_k=h_k, d=d,
                       impl=name)
            try:
                ms = time_ms(fn, device, warmup, rep, [])
                row.update(ms=ms, tflops=flops / ms * 1e-9)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ioattn bench --suite decode", description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=None, help="decode cells b x ctx x page, e.g. 64x4096x16,1x32768x16")
    p.add_argument("--prefill-cells", default=None, help="b x ctx x new x page, e.g. 8x4096x512x16")
    p.add_argument("--heads", default="32,8", help="query,kv heads")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_<gpu>_<date>.json)")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cells = ([tuple(int(x) for x in c.split("x")) for c in a.cells.split(",")] if a.cells
             else DECODE_CELLS)
    # (--prefill-cells "" times no chunked-prefill cell)
    pcells = ([tuple(int(x) for x in c.split("x")) for c in a.prefill_cells.split(",") if c]
              if a.prefill_cells is not None else PREFILL_CELLS)
    h, h_k = (int(x) for x in a.heads.split(","))
    env = collect_env(device)
    rows = run_decode(cells, device, a.warmup, a.rep, h, h_k, a.dim)
    rows += run_prefill([c for c in pcells if c], device, a.warmup, a.rep, h, h_k, a.dim)
    for r in rows:
        val = (f"{r['tb_s']:6.2f} TB/s" if "tb_s" in r else f"{r['tflops']:6.1f} TFLOP/s" if "tflops" in r
               else "ERR " + r.get("error", ""))
        shape = f"b{r['b']} ctx{r['ctx']}" + (f"+{r['new']}" if "new" in r else "") + f" page{r['page']}"
        print(f"{r['kind']:15s} {shape:24s} {r['impl']:26s} {val}")
    gpu = (env.get("gpu") or "cpu").lower().replace(" ", "-")
    path = Path(a.out) if a.out else (Path("benchmarks/results") / f"decode_{gpu}_{env['date'][:10]}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    method = {"decode": "effective bandwidth = K+V bytes of the context / time (q, out ignored); "
                        "the _fp8 rows read an fp8 e4m3 copy of the cache (half the bytes); the "
                        "_graph rows replay the call captured in a CUDA graph (no host time; "
                        "do_bench times each replay with events and flushes L2 before it), "
                        "the _graphloop rows N calls captured back to back in one graph "
                        "(triton.testing.do_bench_cudagraph median of 10 replays, time / N: "
                        "the anchors' graph_us method; no L2 flush between calls), "
                        "the others time eager calls; _hnd: the cache in HND layout, _inorder: "
                        "the NHD cache with each request's pages in order (the others shuffle "
                        "the pages)",
              "chunked_prefill": "flops = 4*b*h*d*sum_i(ctx + i + 1) (causal over context + new); "
                                 "ioattn_kvcache reads FlashInfer's interleaved cache (K and V "
                                 "pages alternate), ioattn_kvcache_pools the same pages as two "
                                 "contiguous pools (vLLM's layout; the sm90 paged forward on "
                                 "Hopper); "
                                 "gather_dense: pages copied to contiguous K/V, then the dense "
                                 "forward (the copy is timed); ioattn_varlen_paged: "
                                 "flash_attn_varlen_func with block_table over the pools "
                                 "(FlashAttention's paged varlen call)",
              "timer": "triton.testing.do_bench median" if device.type == "cuda" else "wall clock",
              "anchors": "SDPA on the same K/V in contiguous [b, h_k, s, d] form (enable_gqa)",
              "max_abs_err": "decode rows: against SDPA on fp32 copies of q, k, v"}
    path.write_text(json.dumps({"env": env, "method": method, "rows": rows}, indent=1))
    print(path)
    return 0

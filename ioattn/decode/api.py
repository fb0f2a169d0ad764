"""``flash_attn_with_kvcache``: FlashAttention's KV-cache call (decode, speculative verification,
chunked prefill onto a cache), with any page size for paged caches."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ioattn.decode.op import eager as kvcache_eager
from ioattn.decode.op import kvcache_fwd
from ioattn.dense.api import (VALIDATED, _check_alibi, _check_common, _check_index, _check_sink,
                              _check_tensor, _fail, _with_sink, check_descale_tensor,
                              skip_value_checks)
from ioattn.dispatch import resolve_backend
from ioattn.reference import kvcache_attention_ref




def _check_values(cache_seqlens: Tensor, s_new: int, capacity: int, cache_leftpad, block_table,
                  n_pages: int, cache_batch_idx, b_cache: int) -> None:
    """Index values against the cache's extent: one host sync per new state of the index tensors
    (``ioattn.dense.api.Validated``); skipped under CUDA graph capture and torch.compile. Writes that bypass
    torch's version counter (a custom kernel, a graph replay) are not seen; the kernels clamp
    every index into the cache, so memory stays safe whatever the values."""
    tensors = (cache_seqlens, cache_leftpad, block_table, cache_batch_idx)
    params = ("kvcache", s_new, capacity, n_pages, b_cache)
    if skip_value_checks(cache_seqlens) or VALIDATED.seen(tensors, params):
        return
    _check_values_now(cache_seqlens, s_new, capacity, cache_leftpad, block_table, n_pages,
                      cache_batch_idx, b_cache)
    VALIDATED.add(tensors, params)


def _check_values_now(cache_seqlens: Tensor, s_new: int, capacity: int, cache_leftpad, block_table,
                      n_pages: int, cache_batch_idx, b_cache: int) -> None:
    lens = cache_seqlens.tolist()
    if not lens:
        return
    if min(lens) < 0 or max(lens) + s_new > capacity:
        _fail(f"cache_seqlens + new tokens must lie in 0..{capacity} (the cache's capacity per "
              f"sequence), got cache_seqlens {lens[:8]} with {s_new} new tokens")
    if cache_leftpad is not None:
        pads = cache_leftpad.tolist()
        if any(p < 0 or p > n for p, n in zip(pads, lens)):
            _fail(f"cache_leftpad must lie in 0..cache_seqlens per sequence, got {pads[:8]}")
    if block_table is not None and block_table.numel():
        lo, hi = int(block_table.min()), int(block_table.max())
        if lo < 0 or hi >= n_pages:
            _fail(f"block_table entries must index the cache's {n_pages} pages, got {lo}..{hi}")
    if cache_batch_idx is not None and cache_batch_idx.numel():
        lo, hi = int(cache_batch_idx.min()), int(cache_batch_idx.max())
        if lo < 0 or hi >= b_cache:
            _fail(f"cache_batch_idx entries must index the cache's {b_cache} rows, got {lo}..{hi}")


# fp8 KV caches: FlashAttention-3's (q, caches and new k / v all e4m3, fp32 descales per
# sequence and KV head), or FlashInfer's kv_data_type (a 16-bit q over an e4m3 / e5m2 cache)
_CACHE_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _cache_dtypes(q: Tensor) -> tuple:
    """The caches' dtypes a q of this dtype reads."""
    if q.dtype in (torch.float16, torch.bfloat16):
        return (q.dtype,) + _CACHE_FP8
    if q.dtype == torch.float8_e4m3fn:
        return (q.dtype,)
    _fail(f"q has dtype {q.dtype}; flash_attn_with_kvcache takes torch.float16 / torch.bfloat16 "
          f"(caches in q's dtype or fp8), or torch.float8_e4m3fn over e4m3 caches", TypeError)


def _fp8_operands(q: Tensor, k_cache: Tensor, descales: tuple) -> tuple[Tensor, Optional[Tensor]]:
    """An fp8 call's q for the 16-bit kernels and the output's scale: q times its descale and
    k's per (sequence, query head) in fp32, rounded to bf16 (an fp8 q) or q's dtype; v's descale
    for the output as [batch, 1, nheads_k, 1 or group, 1] fp32, broadcast over q's heads viewed
    [.., nheads_k, group, d] (None: 1). Validates the descales."""
    b, _, h, _ = q.shape
    h_k = k_cache.shape[-2]
    names = ("q_descale", "k_descale", "v_descale")
    fp8_q, fp8_cache = q.dtype in _CACHE_FP8, k_cache.dtype in _CACHE_FP8
    if h_k == 0 or h % h_k:
        _fail(f"q heads ({h}) must be a multiple of k/v heads ({h_k}) for GQA/MQA")
    per_head = []
    for name, t in zip(names, descales):
        if t is None:
            per_head.append(None)
            continue
        if (name == "q_descale" and not fp8_q) or (name != "q_descale" and not fp8_cache):
            _fail(f"{name} applies to fp8 {'q' if name == 'q_descale' else 'caches'} only; "
                  f"{'q' if name == 'q_descale' else 'k_cache'} is "
                  f"{q.dtype if name == 'q_descale' else k_cache.dtype}")
        check_descale_tensor(name, t, q.device)
        heads = (h_k, h) if name == "q_descale" else (h_k,)
        if t.dim() == 3 and t.shape[2] == 1:  # (batch, heads, 1): per head too
            t = t[:, :, 0]
        if t.dim() != 2 or t.shape[0] != b or t.shape[1] not in heads:
            _fail(f"{name} has shape {tuple(t.shape)}; expected (batch={b}, "
                  f"{' or '.join(map(str, sorted(set(heads))))}) or that with a last dim of 1: "
                  f"one descale per sequence and head (block descales, one per 128 rows, are "
                  f"not taken with a KV cache)")
        # [batch, 1, h_k, group or 1, 1]: broadcast over q's heads as [.., h_k, group, d]
        per_head.append(t.reshape(b, 1, h_k, -1, 1))
    qd, kd, vd = per_head
    dtype = torch.bfloat16 if fp8_q else q.dtype
    if qd is None and kd is None:
        q = q.to(dtype)
    else:
        f = qd if kd is None else kd if qd is None else qd * kd
        q = (q.float().unflatten(2, (h_k, h // h_k)) * f).flatten(2, 3).to(dtype)
    return q, vd


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None,
                            cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None,
                            cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True,
                            alibi_slopes: Optional[Tensor] = None, num_splits: int = 0,
                            return_softmax_lse: bool = False, *,
                            learnable_sink: Optional[Tensor] = None,
                            q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
                            v_descale: Optional[Tensor] = None, backend: str = "auto"):
    """Attention of new query tokens over a KV cache (FlashAttention-2 semantics).

    If k and v are given, they are first written into the caches in place at cache_seqlens (k
    rotated when rotary_cos/rotary_sin are given), and attention runs over the updated caches.

    Args:
        q: [batch, seqlen_q, nheads, headdim], fp16 or bf16, or torch.float8_e4m3fn over an
            e4m3 cache (FlashAttention-3's fp8 KV cache); seqlen_q >= 1 (several tokens for
            speculative verification or chunked prefill; causal aligns them bottom-right).
        k_cache, v_cache: contiguous [batch_cache, seqlen_cache, nheads_k, headdim], or paged
            [num_pages, page_size, nheads_k, headdim] with ``block_table``; any page size >= 1.
            In q's dtype, or fp8 (torch.float8_e4m3fn / float8_e5m2 under a 16-bit q, e4m3
            under an fp8 q): keys and values are converted as they are read.
        k, v: new tokens [batch, seqlen_new, nheads_k, headdim] in the caches' dtype (need
            cache_seqlens); rotary on fp8 keys is computed in fp32 and rounded back to fp8.
        rotary_cos, rotary_sin: [seqlen_ro, rotary_dim / 2]; rotary_dim <= headdim, even. New k
            is rotated at positions cache_seqlens + t; q at cache_seqlens + i when causal or
            windowed, else all q tokens at cache_seqlens (positions count from cache_leftpad).
        cache_seqlens: int or int32 [batch]: tokens already in the cache per sequence.
        cache_batch_idx: int32 [batch]: cache row of each sequence (contiguous caches only).
        cache_leftpad: int32 [batch]: first valid cache position per sequence (default 0).
        block_table: int32 [batch, max_pages_per_seq]: pages of each sequence (paged caches).
        softmax_scale, causal, window_size, softcap, alibi_slopes: as ``flash_attn_func``.
        rotary_interleaved: rotate dim pairs (0, 1), (2, 3)... (GPT-J) instead of halves (NeoX).
        num_splits: key-range splits run in parallel and merged by LSE; 0 picks from the shape.
            Long query chunks on a GPU (chunked prefill) run instead as a copy of the keys into
            packed K/V plus the dense forward (``ioattn.decode.op.gathers``); an explicit
            num_splits > 1 keeps the split-KV kernel.
        return_softmax_lse: also return the LSE [batch, nheads, seqlen_q] fp32 (natural log).
        learnable_sink: [nheads] float, attention sinks as ``flash_attn_func`` (gpt-oss decode):
            one extra logit per head in each row's softmax, no value; the LSE includes it.
        q_descale, k_descale, v_descale: fp8 only (FlashAttention-3's names): fp32 [batch,
            nheads_k] (q_descale also [batch, nheads]; either with a last dim of 1 too),
            x = x_fp8 * descale per sequence and
            head; None is 1. q_descale needs an fp8 q, k_descale / v_descale an fp8 cache. q's
            and k's descales are folded into q (converted to bf16, or kept in its 16-bit dtype)
            and v's into the output, so the kernels are the 16-bit ones reading fp8 K / V.
        backend: 'auto', 'triton' (portable Triton kernels only: the gathered path's dense
            forward then never takes the sm90 Gluon kernel), or 'reference'.

    Returns:
        out [batch, seqlen_q, nheads, headdim] (bf16 for an fp8 q, else q's dtype), or
        (out, softmax_lse); the LSE is over the descaled scores.
    """
    _check_tensor("q", q, 4)
    _check_tensor("k_cache", k_cache, 4)
    _check_tensor("v_cache", v_cache, 4)
    cache_dtypes = _cache_dtypes(q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):  # named here, not as k/v
        if t.dtype not in cache_dtypes or t.dtype != k_cache.dtype:
            _fail(f"{name} has dtype {t.dtype} with q {q.dtype}; the caches must share one of "
                  f"{', '.join(map(str, cache_dtypes))}", TypeError)
        if t.device != q.device:
            _fail(f"{name} is on {t.device} but q is on {q.device}")
        if t.shape[-1] != q.shape[-1]:
            _fail(f"{name} head dim {t.shape[-1]} != q head dim {q.shape[-1]}")
    b, s_q, h, d = q.shape
    v_scale = None
    if (q.dtype in _CACHE_FP8 or k_cache.dtype != q.dtype
            or any(t is not None for t in (q_descale, k_descale, v_descale))):
        q, v_scale = _fp8_operands(q, k_cache, (q_descale, k_descale, v_descale))
    _check_common(q, k_cache, v_cache, 0.0, window_size, softcap, softmax_scale,
                  kv_dtype=k_cache.dtype)
    if v_cache.shape[:3] != k_cache.shape[:3] or v_cache.shape[-1] != d:
        _fail(f"v_cache has shape {tuple(v_cache.shape)}; it must match k_cache "
              f"{tuple(k_cache.shape)} (same head dim as q)")
    if s_q < 1:
        _fail("q must hold at least one token per sequence (seqlen_q >= 1)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            _fail(f"{name} must have a contiguous last dim (it is written in place, not copied)")
    h_k = k_cache.shape[2]
    paged = block_table is not None
    if paged:
        if not isinstance(block_table, Tensor) or block_table.dim() != 2 or block_table.shape[0] != b:
            _fail(f"block_table must be an int32 tensor [batch={b}, max_pages_per_seq]")
        _check_index("block_table", block_table, tuple(block_table.shape), q.device)
        if cache_batch_idx is not None:
            _fail("cache_batch_idx applies to contiguous caches; with block_table, order the "
                  "table's rows instead")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if cache_batch_idx is None and k_cache.shape[0] < b:
            _fail(f"k_cache has {k_cache.shape[0]} rows for batch {b}; pass cache_batch_idx or a "
                  "cache with a row per sequence")
        if cache_batch_idx is not None:
            _check_index("cache_batch_idx", cache_batch_idx, (b,), q.device)
        capacity = k_cache.shape[1]
    s_new = 0
    if (k is None) != (v is None):
        _fail("pass both k and v (new tokens to append) or neither")
    if k is not None:
        _check_tensor("k", k, 4)
        _check_tensor("v", v, 4)
        want = (b, k.shape[1], h_k, d)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want or t.dtype != k_cache.dtype or t.device != q.device:
                _fail(f"{name} must be {k_cache.dtype} (the cache's dtype) on {q.device} with "
                      f"shape {want}, got "
                      f"{t.dtype} on {t.device} with shape {tuple(t.shape)}")
        if cache_seqlens is None:
            _fail("appending k/v needs cache_seqlens (where the new tokens go)")
        s_new = k.shape[1]
    if cache_seqlens is None:
        cache_seqlens = capacity if not paged else _fail(
            "paged caches need cache_seqlens (tokens per sequence)")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    _check_index("cache_seqlens", cache_seqlens, (b,), q.device)
    if cache_leftpad is not None:
        _check_index("cache_leftpad", cache_leftpad, (b,), q.device)
    if (rotary_cos is None) != (rotary_sin is None):
        _fail("pass both rotary_cos and rotary_sin, or neither")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _check_tensor(name, t, 2)
            if t.device != q.device or t.stride(-1) != 1:
                _fail(f"{name} must be on {q.device} with a contiguous last dim")
        if rotary_cos.shape != rotary_sin.shape or 2 * rotary_cos.shape[1] > d:
            _fail(f"rotary_cos/sin must share a shape [seqlen_ro, rotary_dim / 2] with rotary_dim "
                  f"<= headdim {d}; got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        if rotary_cos.shape[0] < capacity:
            _fail(f"rotary_cos/sin have {rotary_cos.shape[0]} positions; the cache holds up to "
                  f"{capacity}, so they need at least that many rows")
    _check_alibi(alibi_slopes, b, h, q.device)
    _check_sink(learnable_sink, h, q.device)
    if not isinstance(num_splits, int) or num_splits < 0:
        _fail(f"num_splits={num_splits!r} must be an int >= 0 (0: automatic)")
    _check_values(cache_seqlens, s_new, capacity, cache_leftpad, block_table, k_cache.shape[0],
                  cache_batch_idx, k_cache.shape[0])
    if q.stride(-1) != 1:
        q = q.contiguous()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    left, right = int(window_size[0]), 0 if causal else int(window_size[1])
    if resolve_backend("triton" if backend == "auto" else backend, q.device) == "reference":
        out, lse, k2, v2 = kvcache_attention_ref(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, causal=causal, window_size=(left, right), softcap=softcap,
            rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, softmax_scale=scale)
        k_cache.copy_(k2)
        v_cache.copy_(v2)
    else:
        # compiled graphs need the op; eager calls skip its dispatch (``op.eager``)
        run = kvcache_fwd if torch.compiler.is_compiling() else kvcache_eager
        out, lse = run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                       cache_batch_idx, cache_leftpad, block_table, alibi_slopes, float(scale),
                       left, right, float(softcap), bool(rotary_interleaved), int(num_splits),
                       backend == "triton")
    if v_scale is not None:
        out.unflatten(2, (v_scale.shape[2], -1)).mul_(v_scale)
    out, lse = _with_sink(out, lse, learnable_sink, False)
    return (out, lse) if return_softmax_lse else out

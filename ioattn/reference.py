"""Plain-PyTorch attention references (CPU-runnable), with the exact semantics ioattn implements.

Layout [batch, seqlen, heads, head_dim] as FlashAttention. Masks align bottom-right when
seqlen_q != seqlen_k; softcap is cap * tanh(s / cap) applied before ALiBi; a query row that sees no
key outputs 0 and LSE -inf. The LSE is in natural log.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def visible_mask_ref(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """[seqlen_q, seqlen_k] bool mask of visible (query, key) pairs; -1 means an unbounded side."""
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_right >= 0:
        mask &= j <= i + window_right
    if window_left >= 0:
        mask &= j >= i - window_left
    return mask


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                  alibi_slopes: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                  dropout_p: float = 0.0, dropout_mask: Optional[torch.Tensor] = None,
                  upcast: bool = True, compute_dtype: torch.dtype = torch.float32,
                  attn_mask: Optional[torch.Tensor] = None,
                  learnable_sink: Optional[torch.Tensor] = None, fp8_p: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention. Returns (out [b, s_q, h, d_v] in q's dtype, lse [b, h, s_q] fp32).

    learnable_sink [h]: one extra logit per head in every row's softmax (no value, never
    masked; gpt-oss's attention sinks); the LSE then includes it.

    attn_mask: bool, broadcastable to [b, h, s_q, s_k], True = attend (a custom mask, combined
    with causal / window).

    upcast=True computes in ``compute_dtype`` (fp32, or fp64 to check the reference itself);
    upcast=False does the same math in the inputs' low precision (the baseline of the test rule).
    dropout_mask: bool keep-mask [b, h, s_q, s_k] (kept elements are scaled by 1 / (1 - p)).

    fp8_p: the fp8 forward's roundings in plain PyTorch (the test rule's low-precision
    baseline for fp8 inputs, given their dequantized values in fp32): the probabilities
    relative to the row max (the kernels: the running max), times 2^8, rounded to e4m3 before
    P·V, the row sums unrounded; out in bf16. No dropout or sink.
    """
    dtype_out = q.dtype
    if upcast:
        q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    b, s_q, h, d = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    if h != h_k:
        k = k.repeat_interleave(h // h_k, dim=2)
        v = v.repeat_interleave(h // h_k, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window_size
    if causal:
        right = 0
    mask = visible_mask_ref(s_q, s_k, left, right, q.device)
    if attn_mask is not None:
        mask = mask & attn_mask.to(q.device)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype)
        slopes = slopes[None, :] if slopes.dim() == 1 else slopes
        i = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)
        j = torch.arange(s_k, device=q.device)[None, :]
        dist = (i - j).abs().to(scores.dtype)
        scores = scores - slopes[:, :, None, None] * dist
    scores = scores.masked_fill(~mask, float("-inf"))
    # softmax in at least fp32 (fp64 when checking the reference itself)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if learnable_sink is not None:  # a sink column, softmaxed with the scores, then dropped
        sink = learnable_sink.to(scores.dtype).view(1, h, 1, 1).expand(b, h, s_q, 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    if fp8_p:
        assert dropout_p == 0 and learnable_sink is None, "fp8_p: no dropout, no sink"
        if scores.shape[-1] == 0:  # no keys
            return v.new_zeros(b, s_q, h, v.shape[-1], dtype=torch.bfloat16), lse.float()
        m = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - torch.where(m == float("-inf"), 0.0, m))  # masked: exp(-inf) = 0
        p8 = (p * 256.0).to(torch.float8_e4m3fn).to(v.dtype)
        out = torch.einsum("bhts,bshd->bthd", p8, v)
        l = (p.sum(-1) * 256.0).transpose(1, 2)[..., None]  # [b, s_q, h, 1]
        out = torch.where(l > 0, out / torch.where(l > 0, l, 1.0), 0.0)
        return out.to(torch.bfloat16), lse.float()
    attn = torch.softmax(scores, dim=-1)
    if learnable_sink is not None:
        attn = attn[..., :s_k]
    attn = attn.masked_fill(~mask.any(-1)[..., None], 0.0)  # no visible key: zeros, never NaN
    if dropout_p > 0:
        assert dropout_mask is not None, "dropout_p > 0 needs the keep-mask"
        attn = attn.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    attn = attn.to(v.dtype)
    out = torch.einsum("bhts,bshd->bthd", attn, v)
    return out.to(dtype_out), lse.float()


def attention_varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                         alibi_slopes: Optional[torch.Tensor] = None,
                         dropout_mask: Optional[Sequence[torch.Tensor]] = None,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence loop over ``attention_ref``. q [total_q, h, d]; returns (out, lse [h, total_q]).

    dropout_mask, if given, is a list of per-sequence keep-masks [h, s_q_i, s_k_i].
    """
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for bi in range(len(cq) - 1):
        qi = q[cq[bi]:cq[bi + 1]].unsqueeze(0)
        ki = k[ck[bi]:ck[bi + 1]].unsqueeze(0)
        vi = v[ck[bi]:ck[bi + 1]].unsqueeze(0)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[bi] if alibi_slopes.dim() == 2 else alibi_slopes
        mask_i = dropout_mask[bi].unsqueeze(0) if dropout_mask is not None else None
        o, lse = attention_ref(qi, ki, vi, alibi_slopes=slopes, dropout_mask=mask_i, **kwargs)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x [s, h, d] at integer ``positions`` [s]: the first 2 * cos.shape[1]
    dims rotate, the rest pass through. interleaved: pairs (0, 1), (2, 3), ... (GPT-J); else the
    two halves of the rotary dims (GPT-NeoX). Computed in fp32, returned in x's dtype."""
    rd = 2 * cos.shape[1]
    c = cos[positions].float()[:, None, :]
    s = sin[positions].float()[:, None, :]
    xr, rest = x[..., :rd].float(), x[..., rd:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def kvcache_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                          rotary_cos: Optional[torch.Tensor] = None,
                          rotary_sin: Optional[torch.Tensor] = None,
                          cache_seqlens: Optional[torch.Tensor] = None,
                          cache_batch_idx: Optional[torch.Tensor] = None,
                          cache_leftpad: Optional[torch.Tensor] = None,
                          block_table: Optional[torch.Tensor] = None, *,
                          causal: bool = False, window_size: Sequence[int] = (-1, -1),
                          softcap: float = 0.0, rotary_interleaved: bool = True,
                          alibi_slopes: Optional[torch.Tensor] = None,
                          softmax_scale: Optional[float] = None, upcast: bool = True,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention's ``flash_attn_with_kvcache`` semantics, one sequence at a time, without
    touching the inputs. Returns (out [b, s_q, h, d], lse [b, h, s_q], k_cache', v_cache') with the
    new k/v written at cache_seqlens (rotated when rotary_cos is given).

    Keys of sequence i are cache positions [leftpad_i, cache_seqlens_i + s_new); paged caches
    [pages, page_size, h_k, d] map position p to page block_table[i, p // page_size]; contiguous
    caches [b_cache, s_cache, h_k, d] use row cache_batch_idx[i] (default i). Rotary positions
    count from leftpad: new k at cache_seqlens - leftpad + t; q likewise when causal or windowed,
    else all q tokens at cache_seqlens - leftpad (FlashAttention's convention).
    """
    b, s_q, h, d = q.shape
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    s_new = 0 if k is None else k.shape[1]
    dev = q.device
    lens = (cache_seqlens.long().tolist() if cache_seqlens is not None
            else [k_cache.shape[1] if block_table is None else 0] * b)
    pads = cache_leftpad.long().tolist() if cache_leftpad is not None else [0] * b
    local = causal or window_size[0] >= 0 or window_size[1] >= 0

    def slots(i: int, positions: torch.Tensor):
        if block_table is None:
            row = int(cache_batch_idx[i]) if cache_batch_idx is not None else i
            return torch.full_like(positions, row), positions
        ps = k_cache.shape[1]
        return block_table[i].long()[positions // ps], positions % ps

    outs, lses = [], []
    for i in range(b):
        qi = q[i]
        if rotary_cos is not None:
            base = lens[i] - pads[i]
            pos = (base + torch.arange(s_q, device=dev)) if local else torch.full((s_q,), base, device=dev)
            qi = rotary_ref(qi, rotary_cos, rotary_sin, pos, rotary_interleaved)
        if s_new:
            kn, vn = k[i], v[i]
            if rotary_cos is not None:
                pos = lens[i] - pads[i] + torch.arange(s_new, device=dev)
                kn = rotary_ref(kn, rotary_cos, rotary_sin, pos, rotary_interleaved)
            pg, off = slots(i, lens[i] + torch.arange(s_new, device=dev))
            k_cache[pg, off] = kn.to(k_cache.dtype)  # (converted as the kernels store them)
            v_cache[pg, off] = vn.to(v_cache.dtype)
        keys = torch.arange(pads[i], lens[i] + s_new, device=dev)
        pg, off = slots(i, keys)
        ki, vi = k_cache[pg, off], v_cache[pg, off]
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[i] if alibi_slopes.dim() == 2 else alibi_slopes
        o, lse = attention_ref(qi[None], ki[None], vi[None], causal=causal, window_size=window_size,
                               softcap=softcap, alibi_slopes=slopes, softmax_scale=softmax_scale,
                               upcast=upcast)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache

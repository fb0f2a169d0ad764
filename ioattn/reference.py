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
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention. Returns (out [b, s_q, h, d_v] in q's dtype, lse [b, h, s_q] fp32).

    upcast=True computes in ``compute_dtype`` (fp32, or fp64 to check the reference itself);
    upcast=False does the same math in the inputs' low precision (the baseline of the test rule).
    dropout_mask: bool keep-mask [b, h, s_q, s_k] (kept elements are scaled by 1 / (1 - p)).
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
    lse = torch.logsumexp(scores, dim=-1)
    attn = torch.softmax(scores, dim=-1)
    attn = attn.masked_fill(~mask.any(-1)[:, None], 0.0)  # no visible key: zeros, never NaN
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

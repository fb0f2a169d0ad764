"""``scaled_dot_product_attention``: torch's SDPA call ([..., heads, seqlen, head_dim] tensors)
on ioattn's kernels.

Same arguments and semantics as ``torch.nn.functional.scaled_dot_product_attention``
(torch >= 2.5): ``is_causal`` is aligned to the top-left corner (query i sees keys 0..i, also
when the sequence lengths differ, unlike ``flash_attn_func``'s bottom-right causal), ``attn_mask``
is a bool mask (True = take part) or a float bias added to the scores, broadcastable to
[..., heads, L, S]; a row with no visible key gives zeros; ``enable_gqa`` lets key / value have
fewer heads than the query (a divisor of its count), and a single key / value head is
broadcast. ``dropout_p`` is applied whenever it is > 0, as torch's functional call does.

How it runs: ``flash_attn_func`` (the fused kernels, forward and backward) on views of the
caller's tensors. Contiguous [..., heads, seqlen, d] tensors with as many key / value heads as
query heads run each (batch, head) pair as a sequence of its own: [batch * heads, seqlen, 1, d]
views, one head packed in each row, which the sm90 kernels read through TMA as they are (no
copies; the output in SDPA's own contiguous layout). Otherwise (GQA, whose query heads share
their K/V head within one call, or the transpose of a [b, s, h, d] projection) the leading dims
fold into the batch and the heads stay a dim: [batch, seqlen, heads, d] views, copied for the
sm90 kernels only where their heads are not packed in a row (the portable kernels take any
strides). The causal forms map onto its masks: L == S is its causal; L < S never shows a query
the keys past L - 1, so it runs causal over the first L keys; L > S is its window (-1, L - S).
``attn_mask``, dtypes other than fp16 / bf16, a scale <= 0 and devices without a Triton backend
have no fused kernel: ``backend='auto'`` (and 'reference') computes them in plain PyTorch (fp32
math, the [L, S] scores in memory, as torch's own math backend); an explicit 'triton' / 'sm90'
raises.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ioattn.dense.api import _fail, flash_attn_func
from ioattn.dispatch import BACKENDS, sm90_unavailable_reason, triton_unavailable_reason

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def _check(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
           dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool,
           backend: str) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dim() < 3:
            _fail(f"{name} has {t.dim()} dims; expected [..., heads, seqlen, head_dim] "
                  f"(at least 3: add a head dim with unsqueeze(-3))")
    if not (query.dtype == key.dtype == value.dtype):
        _fail(f"query, key, value dtypes differ ({query.dtype}, {key.dtype}, {value.dtype}); "
              f"cast them to one", TypeError)
    if not query.dtype.is_floating_point:
        _fail(f"query's dtype {query.dtype} is not a floating type", TypeError)
    if not (query.device == key.device == value.device):
        _fail(f"query, key, value are on different devices ({query.device}, {key.device}, "
              f"{value.device}); move them to one")
    if not (query.dim() == key.dim() == value.dim()) or \
            not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        _fail(f"query, key, value leading (batch) dims differ: {tuple(query.shape[:-3])}, "
              f"{tuple(key.shape[:-3])}, {tuple(value.shape[:-3])}; expand them to one shape")
    if key.shape[-1] != query.shape[-1]:
        _fail(f"key's head_dim {key.shape[-1]} != query's {query.shape[-1]}")
    if key.shape[-2] != value.shape[-2] or key.shape[-3] != value.shape[-3]:
        _fail(f"key [.., {key.shape[-3]}, {key.shape[-2]}, _] and value [.., {value.shape[-3]}, "
              f"{value.shape[-2]}, _] must have the same heads and seqlen")
    h, h_k = query.shape[-3], key.shape[-3]
    if h != h_k and h_k != 1:
        if not enable_gqa:
            _fail(f"query has {h} heads, key / value {h_k}: pass enable_gqa=True for grouped-"
                  f"query attention")
        if h_k == 0 or h % h_k:
            _fail(f"query's {h} heads are not a multiple of key / value's {h_k} (GQA needs it)")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        _fail(f"dropout_p={dropout_p!r} must be a float in [0, 1)")
    if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        _fail(f"scale={scale!r} must be a finite float (or None for 1 / sqrt(head_dim))")
    if not isinstance(backend, str) or backend not in BACKENDS:
        _fail(f"backend={backend!r} is not one of {BACKENDS}")
    if attn_mask is None:
        return
    if is_causal:
        _fail("attn_mask and is_causal=True were both given (as torch's SDPA, one or the "
              "other): fold the causal mask into attn_mask, or drop attn_mask")
    if not isinstance(attn_mask, Tensor):
        _fail(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}", TypeError)
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        _fail(f"attn_mask's dtype {attn_mask.dtype} is neither bool (True = attend) nor a "
              f"float bias", TypeError)
    if attn_mask.device != query.device:
        _fail(f"attn_mask is on {attn_mask.device}, query on {query.device}; move it")
    want = (*query.shape[:-1], key.shape[-2])
    try:
        ok = torch.broadcast_shapes(attn_mask.shape, want) == torch.Size(want)
    except RuntimeError:
        ok = False
    if not ok:
        _fail(f"attn_mask's shape {tuple(attn_mask.shape)} does not broadcast to "
              f"[..., heads, L, S] = {want}")


def sdpa_math(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None
              ) -> Tensor:
    """SDPA in plain PyTorch, computed in fp32 (fp64 inputs in fp64): the path for masks and
    dtypes without a fused kernel, and ``backend='reference'``. Inputs already checked."""
    dtype = query.dtype
    compute = torch.promote_types(dtype, torch.float32)
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    h, h_k = q.shape[-3], k.shape[-3]
    if h_k != h:
        k = k.repeat_interleave(h // h_k, dim=-3)
        v = v.repeat_interleave(h // h_k, dim=-3)
    s_q, s_k = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    visible = None
    if is_causal:
        visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
    elif attn_mask is not None and attn_mask.dtype == torch.bool:
        visible = attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask.to(compute)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    # a row with no visible key (masked, or only -inf biases) gives zeros and zero gradients,
    # as torch's safe softmax (its scores set to 0 first: a softmax of -inf's is NaN, forward
    # and backward)
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    attn = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    if dropout_p > 0:
        attn = torch.nn.functional.dropout(attn, dropout_p, training=True)
    return torch.matmul(attn, v).to(dtype)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, backend: str = "auto") -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on ioattn's kernels.

    Args:
        query: [..., heads, L, head_dim]; key: [..., heads_k, S, head_dim]; value: [...,
            heads_k, S, head_dim_v] (same leading dims; heads_k = heads, 1, or with
            enable_gqa a divisor of heads). fp16 / bf16 run on the fused kernels, head dims
            1..256.
        attn_mask: bool (True = attend) or a float bias, broadcastable to [..., heads, L, S];
            not with is_causal.
        dropout_p: dropout on the attention weights (applied whenever > 0).
        is_causal: causal mask aligned to the top-left corner (query i sees keys 0..i), as
            torch's SDPA; ``flash_attn_func`` aligns bottom-right.
        scale: softmax scale, default 1 / sqrt(head_dim).
        enable_gqa: allow fewer key / value heads than query heads.
        backend: 'auto' (the fused kernels where they cover the call: no attn_mask, fp16 /
            bf16; else plain PyTorch), 'sm90', 'triton' (raise for what the kernels do not
            cover) or 'reference' (plain PyTorch, fp32 math).

    Returns:
        [..., heads, L, head_dim_v] in query's dtype (contiguous, or where the kernels ran on
        [batch, L, heads, d] views a transposed view of their output). Gradients flow to
        query, key and value (not to attn_mask).
    """
    _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend)
    fused = attn_mask is None and query.dtype in _KERNEL_DTYPES
    # (what torch takes and the kernels do not, under 'auto': a scale <= 0, tensors on a device
    # without a Triton backend)
    auto_math = not fused or (scale is not None and scale <= 0) \
        or triton_unavailable_reason(query.device) is not None
    if backend == "reference" or (backend == "auto" and auto_math):
        return sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if not fused:
        why = ("attn_mask (the fused kernels take is_causal or no mask)" if attn_mask is not None
               else f"dtype {query.dtype} (the fused kernels take fp16 / bf16)")
        _fail(f"backend={backend!r} cannot run this call: {why}; pass backend='auto' or "
              f"'reference' (plain PyTorch)")
    s_q, s_k = query.shape[-2], key.shape[-2]
    sm90 = backend != "triton" and query.device.type == "cuda" \
        and sm90_unavailable_reason(query.device) is None
    # each (batch, head) a sequence of its own, [b * h, s, 1, d] views, where that is a view;
    # else [b, s, h, d] views (a [b, s, h, d] projection's transpose is read as it was made)
    folded = key.shape[-3] == query.shape[-3] and all(
        t.is_contiguous() for t in (query, key, value))
    if folded:
        n = math.prod(query.shape[:-2])
        q, k, v = (t.view(n, t.shape[-2], 1, t.shape[-1]) for t in (query, key, value))
    else:
        q, k, v = (t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:]).transpose(1, 2)
                   for t in (query, key, value))
    causal, window = False, (-1, -1)
    if is_causal and s_q <= s_k:  # keys past L - 1 are seen by no query
        k, v, causal = k[:, :s_q], v[:, :s_q], True
    elif is_causal:  # query i sees keys 0..i: FlashAttention's window (-1, L - S)
        window = (-1, int(s_q - s_k))
    if sm90:  # (the sm90 kernels refuse what TMA cannot read: copied for them)
        from ioattn.dense.sm90_common import tma_readable

        q, k, v = (tma_readable(n, t, False) for n, t in (("q", q), ("k", k), ("v", v)))
    out = flash_attn_func(q, k, v, dropout_p=float(dropout_p), softmax_scale=scale,
                          causal=causal, window_size=window, backend=backend)
    if not folded:  # [b, L, h, d_v] -> [b, h, L, d_v] (a view)
        out = out.transpose(1, 2)
    return out.reshape(*query.shape[:-1], value.shape[-1])

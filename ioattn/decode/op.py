"""torch.library op of the KV-cache family: append (rotary) + split-KV attention in one op that
mutates the caches, with a fake impl so torch.compile traces it."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ioattn.decode.triton_decode import kvcache_attn, rope_store
from ioattn.dense.op import _new_output, _on_device


def kvcache_forward(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                    v: Optional[Tensor], rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor],
                    cache_seqlens: Tensor, cache_batch_idx: Optional[Tensor],
                    cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                    alibi_slopes: Optional[Tensor], softmax_scale: float, window_left: int,
                    window_right: int, softcap: float, rotary_interleaved: bool,
                    num_splits: int) -> tuple[Tensor, Tensor]:
    """The op's implementation, also called directly by eager callers (``eager``).

    Arguments as ``flash_attn_with_kvcache`` (validated there); cache_seqlens int32 [b].
    Returns (out [b, s_q, h, d], lse [b, h, s_q] fp32, natural log)."""
    b, s_q, h, d = q.shape
    local = window_left >= 0 or window_right >= 0
    # the kernels read index vectors, slopes and table rows with unit stride, and token rows of
    # q / k / v with a contiguous head dim: copy views that are laid out otherwise
    q, k, v = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes = (
        t if t is None else t.contiguous()
        for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes))
    with _on_device(q):
        if rotary_cos is not None:
            q_rot = torch.empty_like(q)
            rope_store(q, q_rot, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved,
                       per_token_pos=local, leftpad=cache_leftpad)
            q = q_rot
        seqlens_k = cache_seqlens
        if k is not None:
            rope_store(k, k_cache, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved,
                       per_token_pos=True, leftpad=cache_leftpad, block_table=block_table,
                       cache_batch_idx=cache_batch_idx, to_cache=True)
            rope_store(v, v_cache, cache_seqlens, None, None, False, per_token_pos=True,
                       leftpad=cache_leftpad, block_table=block_table,
                       cache_batch_idx=cache_batch_idx, to_cache=True)
            seqlens_k = cache_seqlens + k.shape[1]
        out = _new_output(q, (b, s_q, h, v_cache.shape[-1]))
        lse = _new_output(q, (b, h, s_q), dtype=torch.float32)
        if out.numel():
            kvcache_attn(q, k_cache, v_cache, seqlens_k, cache_leftpad, block_table,
                         cache_batch_idx, alibi_slopes, softmax_scale, window_left, window_right,
                         softcap, num_splits, out, lse)
    return out, lse


kvcache_fwd = torch.library.custom_op("ioattn::kvcache_fwd", kvcache_forward,
                                     mutates_args=("k_cache", "v_cache"))


def eager(*args) -> tuple[Tensor, Tensor]:
    """``kvcache_fwd`` outside torch.compile, without the custom-op dispatch: for a mutable op
    with this many arguments, torch's eager bookkeeping (``fill_defaults`` in the
    ADInplaceOrView kernel) cost ~150 us of host time per call, more than a decode step's
    kernel. Same kernels; the mutated caches' version counters are bumped as the op would."""
    out, lse = kvcache_forward(*args)
    if args[3] is not None:  # k given: the new tokens were written into both caches
        torch.autograd.graph.increment_version(args[1])
        torch.autograd.graph.increment_version(args[2])
    return out, lse


@kvcache_fwd.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
      cache_leftpad, block_table, alibi_slopes, softmax_scale, window_left, window_right, softcap,
      rotary_interleaved, num_splits):
    b, s_q, h, _ = q.shape
    return (q.new_empty((b, s_q, h, v_cache.shape[-1])),
            q.new_empty((b, h, s_q), dtype=torch.float32))

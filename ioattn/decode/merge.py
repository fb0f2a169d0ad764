"""Merging attention states by their LSE (cascade attention: a shared prefix attended once, each
request's suffix separately, the two results merged), FlashInfer's ``merge_state``,
``merge_state_in_place`` and ``merge_states``.

A state is (v, s): v [seq_len, num_heads, head_dim] the normalized attention output over some
keys and s [seq_len, num_heads] fp32 the base-2 LSE of those keys' scores (FlashInfer's
convention, what its and ``ioattn.flashinfer``'s ``return_lse`` give). Attention over the union
of two disjoint key sets is then

    s = log2(2^s_a + 2^s_b),   v = 2^(s_a - s) v_a + 2^(s_b - s) v_b,

computed in fp32 with the larger LSE subtracted first. A state over no key (s = -inf) weighs 0;
when every state is empty the result is v = 0, s = -inf (FlashInfer leaves that case undefined).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ioattn.decode.triton_decode import COMBINE_SLOTS, _merge_slots, _pow2
from ioattn.launch import launcher


@triton.jit
def _merge_two_kernel(VA, SA, VB, SB, VO, SO, MASK, n_heads, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr):
    """One (position, head): the merge of state a and state b into (VO, SO), which may be a's
    own buffers (in place); rows whose MASK is False are left as they are."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    if HAS_MASK:
        if tl.load(MASK + i) == 0:
            return
    row = i.to(tl.int64) * n_heads + h
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    s_a = tl.load(SA + row)
    s_b = tl.load(SB + row)
    v_a = tl.load(VA + row * HEAD_DIM + o_d, mask=m_d, other=0.0).to(tl.float32)
    v_b = tl.load(VB + row * HEAD_DIM + o_d, mask=m_d, other=0.0).to(tl.float32)
    m = tl.maximum(s_a, s_b)
    m_use = tl.where(m == float("-inf"), 0.0, m)  # both empty: weights 0, not NaN
    w_a = tl.exp2(s_a - m_use)
    w_b = tl.exp2(s_b - m_use)
    l = w_a + w_b
    empty = l == 0.0
    v = (w_a * v_a + w_b * v_b) / tl.where(empty, 1.0, l)
    tl.store(VO + row * HEAD_DIM + o_d, v.to(VO.dtype.element_ty), mask=m_d)
    tl.store(SO + row, tl.where(empty, float("-inf"), m_use + tl.log2(tl.where(empty, 1.0, l))))


@triton.jit
def _merge_many_kernel(V, S, VO, SO, n_states, n_heads, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One (position, head): the merge of its n_states states (V [seq, states, heads, d], S
    [seq, states, heads]), BLOCK_S states per step."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    row0 = i.to(tl.int64) * n_states * n_heads + h
    v, s = _merge_slots(V, S, row0, row0, n_heads, n_heads, 0, n_states, True, HEAD_DIM, BLOCK_D,
                        BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    out_row = i.to(tl.int64) * n_heads + h
    tl.store(VO + out_row * HEAD_DIM + o_d, v.to(VO.dtype.element_ty), mask=o_d < HEAD_DIM)
    tl.store(SO + out_row + tl.arange(0, 1), s)


_V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_state(name_v: str, v: Tensor, name_s: str, s: Tensor, v_dims: int) -> None:
    if not isinstance(v, Tensor) or not isinstance(s, Tensor):
        raise TypeError(f"{name_v} and {name_s} must be tensors")
    if v.dim() != v_dims or s.dim() != v_dims - 1 or tuple(s.shape) != tuple(v.shape[:-1]):
        want = ("[seq_len, num_heads, head_dim] and [seq_len, num_heads]" if v_dims == 3 else
                "[seq_len, num_states, num_heads, head_dim] and [seq_len, num_states, num_heads]")
        raise ValueError(f"{name_v} {tuple(v.shape)} and {name_s} {tuple(s.shape)} must be {want}")
    if v.dtype not in _V_DTYPES:
        raise TypeError(f"{name_v} must be float16, bfloat16 or float32, got {v.dtype}")
    if s.dtype != torch.float32:
        raise TypeError(f"{name_s} (the base-2 LSE) must be float32, got {s.dtype}")
    if s.device != v.device:
        raise ValueError(f"{name_v} and {name_s} must be on one device")


def _check_pair(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor, names: tuple) -> None:
    _check_state(names[0], v_a, names[1], s_a, 3)
    _check_state(names[2], v_b, names[3], s_b, 3)
    if v_b.shape != v_a.shape or v_b.device != v_a.device:
        raise ValueError(f"{names[2]} {tuple(v_b.shape)} must match {names[0]} "
                         f"{tuple(v_a.shape)} on the same device")


def _launch_two(v_a, s_a, v_b, s_b, v_out, s_out, mask: Optional[Tensor]) -> None:
    seq, h, d = v_a.shape
    if seq * h == 0:
        return
    launcher(_merge_two_kernel)[(seq, h)](
        v_a, s_a, v_b, s_b, v_out, s_out, mask if mask is not None else s_a, h,
        HEAD_DIM=d, BLOCK_D=_pow2(d, 16), HAS_MASK=mask is not None, num_warps=1)


def merge_state(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two attention states over disjoint key sets: v [seq_len, num_heads, head_dim]
    (fp16/bf16/fp32), s [seq_len, num_heads] fp32 base-2 LSE. Returns (v, s), v in v_a's dtype."""
    _check_pair(v_a, s_a, v_b, s_b, ("v_a", "s_a", "v_b", "s_b"))
    v_a, s_a, v_b, s_b = (t.contiguous() for t in (v_a, s_a, v_b, s_b))
    v_out = torch.empty_like(v_a)
    s_out = torch.empty_like(s_a)
    _launch_two(v_a, s_a, v_b, s_b, v_out, s_out, None)
    return v_out, s_out


def merge_state_in_place(v: Tensor, s: Tensor, v_other: Tensor, s_other: Tensor,
                         mask: Optional[Tensor] = None) -> None:
    """Merge (v_other, s_other) into (v, s) in place (both contiguous); with ``mask`` [seq_len]
    bool, only the positions where it is True."""
    _check_pair(v, s, v_other, s_other, ("v", "s", "v_other", "s_other"))
    if not (v.is_contiguous() and s.is_contiguous()):
        raise ValueError("v and s are updated in place and must be contiguous")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (v.shape[0],):
            raise ValueError(f"mask must be a bool tensor [seq_len={v.shape[0]}]")
        if mask.device != v.device:
            raise ValueError("mask must be on v's device")
        mask = mask.contiguous().view(torch.uint8)
    _launch_two(v, s, v_other.contiguous(), s_other.contiguous(), v, s, mask)


def merge_states(v: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """Merge num_states attention states per position: v [seq_len, num_states, num_heads,
    head_dim], s [seq_len, num_states, num_heads] fp32 base-2 LSE. Returns (v [seq_len, num_heads,
    head_dim] in v's dtype, s [seq_len, num_heads])."""
    _check_state("v", v, "s", s, 4)
    v, s = v.contiguous(), s.contiguous()
    seq, n_states, h, d = v.shape
    v_out = torch.empty(seq, h, d, device=v.device, dtype=v.dtype)
    s_out = torch.empty(seq, h, device=v.device, dtype=torch.float32)
    if seq * h == 0:
        return v_out, s_out
    launcher(_merge_many_kernel)[(seq, h)](v, s, v_out, s_out, n_states, h, HEAD_DIM=d,
                                 BLOCK_D=_pow2(d, 16), BLOCK_S=COMBINE_SLOTS, num_warps=1)
    return v_out, s_out

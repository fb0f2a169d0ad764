"""FP8 attention inputs: block quantization and incoherent processing (FlashAttention-3, sec. 3.3).

``flash_attn_func`` / ``flash_attn_varlen_func`` take q, k, v in ``torch.float8_e4m3fn`` with
fp32 descales (x = x_fp8 * descale) and return O in bf16 (forward only, as FlashAttention-3's
fp8 path). A descale is one of:

- None: 1;
- [batch, heads] (FlashAttention-3's form; heads = nheads_k for k and v, nheads or nheads_k for
  q): one number per sequence and head;
- [batch, heads, ceil(seqlen / QUANT_BLOCK)]: block quantization, one number per block of
  QUANT_BLOCK (128) rows of a sequence and head (varlen: blocks counted from each sequence's
  start, ceil(max_seqlen / 128) of them).

``quantize`` makes either form from a bf16 / fp16 / fp32 tensor; ``hadamard_transform`` (with
random signs) is the incoherent processing: Q and K multiplied by one orthogonal matrix leave
Q·Kᵀ unchanged while spreading an outlier channel's magnitude over all channels, so a block's
scale fits its values better (``quantize_qkv(..., hadamard=True)`` does both).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ioattn.dense.triton_fwd import FP8_BLOCK

QUANT_BLOCK = FP8_BLOCK
FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0  # the largest finite e4m3 value

__all__ = ["QUANT_BLOCK", "FP8_DTYPE", "quantize", "dequantize", "hadamard_transform",
           "random_signs", "keys_contiguous", "quantize_qkv"]


def _seq_index(x: Tensor, cu_seqlens: Optional[Tensor]):
    """(batch, rows' sequence index, rows' position in their sequence, longest sequence) of a
    batched [b, s, h, d] (cu_seqlens None) or varlen [total, h, d] tensor."""
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"x must be [batch, seqlen, heads, headdim] (or pass cu_seqlens for "
                             f"[total, heads, headdim]), got shape {tuple(x.shape)}")
        b, s = x.shape[0], x.shape[1]
        rows = torch.arange(s, device=x.device)
        return b, None, rows, s
    if x.dim() != 3:
        raise ValueError(f"with cu_seqlens, x must be [total, heads, headdim], got {tuple(x.shape)}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be int32 [batch + 1] prefix sums")
    cu = cu_seqlens.to(x.device).long()
    b = cu.numel() - 1
    if int(cu[-1]) > x.shape[0]:
        raise ValueError(f"cu_seqlens[-1] = {int(cu[-1])} > x's {x.shape[0]} rows")
    r = torch.arange(x.shape[0], device=x.device)
    seq = (torch.searchsorted(cu, r, right=True) - 1).clamp(0, b - 1)
    lengths = cu[1:] - cu[:-1]
    return b, seq, r - cu[seq], int(lengths.max()) if b else 0


def quantize(x: Tensor, *, block_size: Optional[int] = QUANT_BLOCK,
             cu_seqlens: Optional[Tensor] = None,
             max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(x in fp8 e4m3, fp32 descale) with x ~= x_fp8 * descale, descale = amax / 448 per group.

    x: [batch, seqlen, heads, headdim], or [total, heads, headdim] with int32 ``cu_seqlens``.
    block_size: QUANT_BLOCK (128, default): descale [batch, heads, ceil(seqlen / 128)], one per
    128 rows of a sequence and head (block quantization); None: [batch, heads], one per sequence
    and head (FlashAttention-3's descale form). A group of zeros gets descale 1. Varlen: the
    blocks are counted up to ``max_seqlen`` (the value the attention call will get; default the
    longest sequence), and rows past cu_seqlens[-1] are quantized with the last sequence's last
    block without entering its descale."""
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise TypeError("x must be a bf16 / fp16 / fp32 tensor")
    if block_size not in (None, QUANT_BLOCK):
        raise ValueError(f"block_size={block_size!r}: the kernels read descales per block of "
                         f"{QUANT_BLOCK} rows (QUANT_BLOCK) or per sequence (None)")
    b, seq, pos, s = _seq_index(x, cu_seqlens)
    if seq is not None and max_seqlen is not None:
        if max_seqlen < s:
            raise ValueError(f"max_seqlen={max_seqlen} < the longest sequence ({s})")
        s = max_seqlen
    h = x.shape[-2]
    nb = max(1, math.ceil(s / QUANT_BLOCK)) if block_size else 1
    blk = (pos // QUANT_BLOCK).clamp(max=nb - 1) if block_size else torch.zeros_like(pos)
    row_amax = x.detach().abs().float().amax(-1)  # [b, s, h] or [total, h]
    if seq is not None:  # rows past the last sequence: outside every group
        row_amax = row_amax * (torch.arange(x.shape[0], device=x.device)
                               < int(cu_seqlens[-1]))[:, None]
    if seq is None:
        amax = row_amax.new_zeros(b, nb, h)
        amax.scatter_reduce_(1, blk[None, :, None].expand_as(row_amax), row_amax, "amax")
        group = amax.transpose(1, 2)  # [b, h, nb]
    else:
        amax = row_amax.new_zeros(b * nb, h)
        amax.scatter_reduce_(0, (seq * nb + blk)[:, None].expand_as(row_amax), row_amax, "amax")
        group = amax.view(b, nb, h).transpose(1, 2)
    descale = torch.where(group > 0, group / _FP8_MAX, torch.ones_like(group)).contiguous()
    per_row = _per_row(descale, seq, blk, x)
    x8 = (x.float() / per_row).clamp(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE)
    return x8, descale if block_size else descale[:, :, 0].contiguous()


def _per_row(descale: Tensor, seq: Optional[Tensor], blk: Tensor, x: Tensor) -> Tensor:
    """descale [b, h, nb] broadcast to x's rows: [b, s, h, 1] or [total, h, 1]."""
    blk = blk.clamp(max=descale.shape[2] - 1)
    if seq is None:
        return descale[:, :, blk].transpose(1, 2)[..., None]
    return descale[seq, :, blk][..., None]


def dequantize(x8: Tensor, descale: Optional[Tensor], *, cu_seqlens: Optional[Tensor] = None,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """x8 * descale in ``dtype``; descale None, [batch, heads] or [batch, heads, blocks] (as
    ``flash_attn_func`` takes it; heads may be a divisor of x8's, as a q descale per KV head)."""
    x = x8.to(torch.float32)
    if descale is None:
        return x.to(dtype)
    b, seq, pos, _ = _seq_index(x8, cu_seqlens)
    d = descale.float()
    if d.dim() == 2:
        d = d[:, :, None]
    h = x8.shape[-2]
    d = d.repeat_interleave(h // d.shape[1], dim=1)  # (a per-KV-head q descale)
    blk = pos // QUANT_BLOCK if d.shape[2] > 1 else torch.zeros_like(pos)
    return (x * _per_row(d, seq, blk, x8)).to(dtype)


def random_signs(d: int, *, seed: int = 0, device=None) -> Tensor:
    """A fixed random +-1 vector [d] (fp32) from ``seed``: the diagonal of incoherent processing."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (d,), generator=g) * 2 - 1).float().to(device)


def _hadamard(n: int, device) -> Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(device)


def hadamard_transform(x: Tensor, signs: Optional[Tensor] = None) -> Tensor:
    """x · diag(signs) · H along the last dim, in x's dtype (computed in fp32). H is the
    orthonormal Sylvester-Hadamard matrix of the largest power of two dividing the head dim,
    repeated block-diagonally (96 = 3 x 32), so (q H')(k H')ᵀ = q kᵀ for any head dim."""
    d = x.shape[-1]
    n = d & -d  # the largest power of two dividing d
    y = x.float()
    if signs is not None:
        if signs.shape != (d,):
            raise ValueError(f"signs must be [{d}] (the head dim), got {tuple(signs.shape)}")
        y = y * signs.to(y.device, torch.float32)
    y = y.reshape(*x.shape[:-1], d // n, n) @ _hadamard(n, x.device)
    return y.reshape(x.shape).to(x.dtype)


def keys_contiguous(v: Tensor) -> Tensor:
    """V with the same shape ([b, s, h, d] or [total, h, d]) and values, stored with its keys
    innermost ([b, h, d, s] / [h, d, total] in memory): the layout the fp8 forward's P·V reads
    as Hopper's fp8 wgmma wants its operand (K-major), without a transpose per key block. Any
    other layout is accepted too (transposed in the kernel)."""
    if v.dim() == 4:
        return v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    if v.dim() == 3:
        return v.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    raise ValueError(f"v must be [batch, seqlen, heads, headdim] or [total, heads, headdim], got "
                     f"{tuple(v.shape)}")


def quantize_qkv(q: Tensor, k: Tensor, v: Tensor, *, block_size: Optional[int] = QUANT_BLOCK,
                 hadamard: bool = False, seed: int = 0, cu_seqlens_q: Optional[Tensor] = None,
                 cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                 max_seqlen_k: Optional[int] = None, v_keys_contiguous: bool = True):
    """(q8, k8, v8, q_descale, k_descale, v_descale) for ``flash_attn_func`` (or the varlen call
    with cu_seqlens_q / cu_seqlens_k and the max_seqlen_q / max_seqlen_k it will get). hadamard=True applies ``hadamard_transform`` with one
    ``random_signs(seed)`` vector to q and k first (incoherent processing: scores unchanged in
    exact arithmetic, outlier channels spread before quantization); v is quantized as it is,
    and returned in ``keys_contiguous`` layout unless v_keys_contiguous=False."""
    if hadamard:
        signs = random_signs(q.shape[-1], seed=seed, device=q.device)
        q, k = hadamard_transform(q, signs), hadamard_transform(k, signs)
    q8, qd = quantize(q, block_size=block_size, cu_seqlens=cu_seqlens_q, max_seqlen=max_seqlen_q)
    k8, kd = quantize(k, block_size=block_size, cu_seqlens=cu_seqlens_k, max_seqlen=max_seqlen_k)
    v8, vd = quantize(v, block_size=block_size, cu_seqlens=cu_seqlens_k, max_seqlen=max_seqlen_k)
    return q8, k8, keys_contiguous(v8) if v_keys_contiguous else v8, qd, kd, vd

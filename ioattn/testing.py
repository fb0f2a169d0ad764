"""Test helpers: FlashAttention's tolerance rule, random inputs and varlen lengths.

The rule: the kernel's max error against an fp32 reference must be at most ``factor`` times the
error of the same computation done by plain PyTorch in the low precision, plus an atol equal to the
fp32 rounding noise at the reference's magnitude (FA3's choice, floored, see ``rounding_atol``).
"""
from __future__ import annotations

import torch

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0


def rounding_atol(ref: torch.Tensor) -> float:
    """fp32 rounding noise at the reference's magnitude (floored at unit magnitude, so a reference
    that is exactly 0 by cancellation, e.g. dq with a single key, still allows fp32 noise)."""
    r = ref.float()
    if not r.numel():
        return 0.0
    fa3 = 2.0 * ((r + 0.3 - 0.3) - r).abs().max().item()
    return max(fa3, 1e-5 * max(1.0, r.abs().max().item()))


def assert_close_rule(name: str, out: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor,
                      factor: float = OUT_FACTOR) -> None:
    """Assert |out - ref|_max <= factor * |pt - ref|_max + atol; NaN never passes."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if out.numel() == 0:
        return
    out_f, ref_f, pt_f = out.float(), ref.float(), pt.float()
    assert not torch.isnan(out_f).any(), f"{name}: NaN in output (unwritten or bad math)"
    err = (out_f - ref_f).abs().max().item()
    base = (pt_f - ref_f).abs().max().item()
    atol = rounding_atol(ref_f)
    assert err <= factor * base + atol, (
        f"{name}: max err {err:.3e} > {factor} x PyTorch low-precision err {base:.3e} + atol {atol:.1e}")


def random_seqlens(batch: int, max_len: int, generator: torch.Generator | None = None,
                   allow_zero: bool = True) -> list[int]:
    lo = 0 if allow_zero else 1
    return torch.randint(lo, max_len + 1, (batch,), generator=generator).tolist()


def cu_seqlens(lengths: list[int], device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def alibi_slopes(batch: int | None, nheads: int, device) -> torch.Tensor:
    """Random positive fp32 slopes, (nheads,) or (batch, nheads)."""
    shape = (nheads,) if batch is None else (batch, nheads)
    return torch.rand(shape, dtype=torch.float32, device=device) * 0.3

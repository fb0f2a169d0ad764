"""Test helpers: FlashAttention's tolerance rule, random inputs and varlen lengths.

The rule: the kernel's max error against an fp32 reference must be at most ``factor`` times the
error of the same computation done by plain PyTorch in the low precision, plus an atol equal to the
output dtype's rounding noise at the reference's magnitude (FA3's choice, see ``rounding_atol``).
"""
from __future__ import annotations

import torch

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0


def rounding_atol(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Rounding noise of ``dtype`` at the reference's magnitude: FA3's ``2 * |(r + 0.3 - 0.3) - r|``
    with r the reference cast to the kernel's output dtype (about one ulp at the largest magnitude,
    the unavoidable cost of storing the result in that dtype). Floored at fp32 noise of unit
    magnitude, so a reference that is exactly 0 by cancellation (dq with a single key) still allows
    fp32 noise."""
    if not ref.numel():
        return 0.0
    r = ref.to(dtype)
    fa3 = 2.0 * ((r + 0.3 - 0.3) - r).abs().max().item()
    return max(fa3, 1e-5 * max(1.0, ref.float().abs().max().item()))


def rule_check(out: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor,
               factor: float = OUT_FACTOR) -> tuple[bool, float, float, float]:
    """(ok, err, pt_err, atol) for |out - ref|_max <= factor * |pt - ref|_max + atol; NaN fails."""
    out_f, ref_f, pt_f = out.float(), ref.float(), pt.float()
    if torch.isnan(out_f).any():
        return False, float("nan"), 0.0, 0.0
    err = (out_f - ref_f).abs().max().item()
    base = (pt_f - ref_f).abs().max().item()
    atol = rounding_atol(ref_f, out.dtype)
    return err <= factor * base + atol, err, base, atol


def assert_close_rule(name: str, out: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor,
                      factor: float = OUT_FACTOR) -> None:
    """Assert FlashAttention's rule (see ``rule_check``)."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if out.numel() == 0:
        return
    ok, err, base, atol = rule_check(out, ref, pt, factor)
    assert ok, (f"{name}: max err {err:.3e} > {factor} x PyTorch low-precision err {base:.3e} "
                f"+ atol {atol:.1e} (NaN means unwritten output or bad math)")


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

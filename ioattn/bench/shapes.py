"""Shape registry for the dense-attention benchmark grid (FlashAttention-paper style)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch

TOKENS = 16384  # batch * seqlen is held fixed so every cell moves the same number of tokens
HIDDEN = 2048  # heads * headdim is held fixed, as in the FlashAttention-2 paper plots
DIMS = (64, 128, 256)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
MODES = ("fwd", "bwd")
QUICK_DIMS = (64, 128)
QUICK_SEQLENS = (1024, 8192)

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

FLOPS_FORMULA = ("fwd = 4*b*h*s*s*d (x0.5 if causal; 2*b*h*s*s*(d + d_v) when d_v != d); "
                 "bwd = 2.5*fwd; TFLOP/s = flops / time")


@dataclass(frozen=True)
class Shape:
    mode: str  # "fwd" or "bwd"
    d: int
    h: int
    s: int
    b: int
    causal: bool
    dtype: str  # key of DTYPES
    softcap: float = 0.0  # cap * tanh(score / cap) before the softmax (0: none); a run's setting
    d_v: Optional[int] = None  # V's (and O's) head dim when it differs from d (e.g. 192 / 128)

    @property
    def dv(self) -> int:
        return self.d_v or self.d

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def data_key(self) -> tuple:
        """Identifies the tensors (fwd and bwd cells of the same problem share compiled anchors)."""
        return (self.b, self.h, self.s, self.d, self.d_v, self.causal, self.dtype, self.softcap)

    def flops(self) -> float:
        f = 2.0 * self.b * self.h * self.s * self.s * (self.d + self.dv)  # QKᵀ and PV
        if self.causal:
            f /= 2
        return f * 2.5 if self.mode == "bwd" else f

    def label(self) -> str:
        dims = f"d{self.d}" + (f"x{self.d_v}" if self.d_v else "")
        return f"{self.mode} {self.dtype} {dims} s{self.s} {'C' if self.causal else 'N'}"


def fa_grid(
    tokens: int = TOKENS,
    hidden: int = HIDDEN,
    dims: Iterable[Union[int, tuple[int, int]]] = DIMS,
    seqlens: Iterable[int] = SEQLENS,
    causals: Iterable[bool] = (False, True),
    dtypes: Iterable[str] = ("bf16",),
    modes: Iterable[str] = MODES,
    softcap: float = 0.0,
) -> list[Shape]:
    """The grid in run order; mode is innermost so fwd/bwd of a problem reuse one flex compile.
    A dims entry (d, d_v) times V (and O) at d_v columns, heads = hidden // d."""
    out: list[Shape] = []
    for dt in dtypes:
        if dt not in DTYPES:
            raise ValueError(f"unknown dtype {dt!r}; choose from {sorted(DTYPES)}")
        for dims_ in dims:
            d, d_v = dims_ if isinstance(dims_, tuple) else (dims_, dims_)
            if hidden % d:
                raise ValueError(f"hidden {hidden} is not a multiple of d={d}")
            for s in seqlens:
                if s > tokens:  # batch would be 0
                    continue
                for causal in causals:
                    for mode in modes:
                        if mode not in MODES:
                            raise ValueError(f"unknown mode {mode!r}")
                        out.append(Shape(mode, d, hidden // d, s, tokens // s, causal, dt,
                                         softcap, None if d_v == d else d_v))
    return out

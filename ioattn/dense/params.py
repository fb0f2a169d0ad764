"""The validated, normalized description of one attention call, shared by fwd and bwd launchers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class AttnParams:
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    head_dim: int
    head_dim_v: int
    softmax_scale: float
    window_left: int  # -1: unbounded
    window_right: int  # -1: unbounded; causal is 0
    softcap: float
    dropout_p: float
    alibi_slopes: Optional[torch.Tensor]
    cu_seqlens_q: Optional[torch.Tensor]
    cu_seqlens_k: Optional[torch.Tensor]
    rng_state: Optional[torch.Tensor]
    rng_rows: int  # query rows of one head over the whole batch (dropout's Philox row index space)
    # fp8 calls: fp32 descales as [batch, heads, blocks] views (heads: nheads or nheads_k for q,
    # nheads_k for k and v; a per-head descale has blocks expanded with stride 0), else None
    q_descale: Optional[torch.Tensor] = None
    k_descale: Optional[torch.Tensor] = None
    v_descale: Optional[torch.Tensor] = None

    @property
    def fp8(self) -> bool:
        return self.q_descale is not None

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def causal_like(self) -> bool:
        return self.window_right >= 0 or self.window_left >= 0

    def batch_strides(self, t: torch.Tensor) -> int:
        return 0 if self.is_varlen else t.stride(0)

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        # batched LSE is [b, h, s_q]; varlen LSE is [h, total_q]; the row stride is 1 in both
        return (0, lse.stride(0)) if self.is_varlen else (lse.stride(0), lse.stride(1))

    @property
    def alibi_batch_stride(self) -> int:
        s = self.alibi_slopes
        return s.stride(0) if s is not None and s.dim() == 2 else 0

    # Triton needs a pointer for every tensor argument; unused ones get a placeholder that the
    # kernel never dereferences (its constexpr flag is off).
    def alibi_arg(self, like: torch.Tensor) -> torch.Tensor:
        return self.alibi_slopes if self.alibi_slopes is not None else like

    def cu_q_arg(self, like: torch.Tensor) -> torch.Tensor:
        return self.cu_seqlens_q if self.cu_seqlens_q is not None else like

    def cu_k_arg(self, like: torch.Tensor) -> torch.Tensor:
        return self.cu_seqlens_k if self.cu_seqlens_k is not None else like

    def rng_arg(self, like: torch.Tensor) -> torch.Tensor:
        return self.rng_state if self.rng_state is not None else like


def make_params(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                window_left: int, window_right: int, softcap: float,
                alibi_slopes: Optional[torch.Tensor], dropout_p: float,
                rng_state: Optional[torch.Tensor], descales=None) -> AttnParams:
    """Build params from op arguments (already validated by the public functions); descales:
    (q, k, v) descales of an fp8 call, each None (1) or fp32 [batch, heads] / [batch, heads,
    blocks]."""
    # the kernels index slopes and cu_seqlens with unit inner stride
    alibi_slopes, cu_seqlens_q, cu_seqlens_k = (
        t.contiguous() if t is not None else None for t in (alibi_slopes, cu_seqlens_q, cu_seqlens_k))
    if cu_seqlens_q is not None:
        batch = cu_seqlens_q.shape[0] - 1
        rng_rows = q.shape[0]
    else:
        batch = q.shape[0]
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
        rng_rows = batch * max_seqlen_q
    return AttnParams(
        batch=batch, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        head_dim=q.shape[-1], head_dim_v=v.shape[-1], softmax_scale=softmax_scale,
        window_left=window_left, window_right=window_right, softcap=softcap,
        dropout_p=dropout_p if rng_state is not None else 0.0, alibi_slopes=alibi_slopes,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, rng_state=rng_state,
        rng_rows=rng_rows,
        **({} if descales is None else fp8_descales(q, k, batch, *descales)),
    )


def fp8_descales(q: torch.Tensor, k: torch.Tensor, batch: int, q_descale, k_descale,
                 v_descale) -> dict:
    """AttnParams' descale fields: each as a [batch, heads, blocks] fp32 view (None: ones)."""
    out = {}
    one = None  # (one new 1.0 a call for every missing descale: one kept across calls could
    # land in a CUDA graph tree's pool during its warm-up, where nothing tracks it, and be
    # reused under it)
    for name, t, heads in (("q_descale", q_descale, q.shape[-2]), ("k_descale", k_descale, k.shape[-2]),
                           ("v_descale", v_descale, k.shape[-2])):
        if t is None:
            if one is None:
                one = torch.ones((), dtype=torch.float32, device=q.device)
            t = one.expand(batch, heads, 1)
        elif t.dim() == 2:
            t = t[:, :, None]
        if t.shape[2] == 1:  # one descale for every block: the kernels read block 0's
            t = t.as_strided(t.shape, (t.stride(0), t.stride(1), 0))
        out[name] = t
    return out


_INT32_MAX = 2**31 - 1


def check_int32_rows(max_rows: int, **tensors: torch.Tensor) -> None:
    """The kernels index rows within one sequence in int32 (batch and head offsets are int64).

    Raise instead of overflowing silently when one sequence of a tensor spans 2^31 elements or
    more (e.g. s=256k with 64 heads of d=128 in one [s, h, d] tensor).
    """
    for name, t in tensors.items():
        if t.dim() < 3:
            continue
        extent = (max_rows + 256) * t.stride(-3) + t.shape[-2] * t.stride(-2)  # +256: tile rounding
        if extent > _INT32_MAX:
            raise ValueError(
                f"{name}: one sequence spans {max_rows} rows x row stride {t.stride(-3)} >= 2^31 "
                f"elements, beyond the kernels' int32 in-sequence indexing; pass fewer heads per call "
                f"as contiguous tensors or split the sequence")

"""Implementations timed side by side: ioattn and the PyTorch anchors it is compared against.

ioattn takes FlashAttention-2 layout [b, s, h, d]; SDPA and Flex get their native [b, h, s, d]
layout as separate contiguous tensors, made once outside the timed region, so no anchor pays
for a transpose inside the timer.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import torch
import torch.nn.functional as F

from .shapes import Shape

Tensor = torch.Tensor


def get_ioattn_func() -> Callable[..., Tensor]:
    """Looked up at build time (not import time): the package is developed concurrently, and
    tests monkeypatch this function with a PyTorch stand-in."""
    from ioattn import flash_attn_func

    return flash_attn_func


@dataclass
class Inputs:
    """One cell's data. bshd tensors are leaves; bhsd copies are their own leaves, made lazily once."""

    q: Tensor
    k: Tensor
    v: Tensor
    dout: Tensor
    requires_grad: bool
    _bhsd: Optional[tuple[Tensor, ...]] = field(default=None, repr=False)

    def bhsd(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if self._bhsd is None:
            q, k, v = (
                t.detach().transpose(1, 2).contiguous().requires_grad_(self.requires_grad)
                for t in (self.q, self.k, self.v)
            )
            self._bhsd = (q, k, v, self.dout.transpose(1, 2).contiguous())
        return self._bhsd  # type: ignore[return-value]


def make_inputs(shape: Shape, device: torch.device, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    rg = shape.mode == "bwd"
    def rnd(d: int) -> Tensor:
        return torch.randn((shape.b, shape.s, shape.h, d), generator=gen, device=device,
                           dtype=shape.torch_dtype)

    q, k, v, dout = rnd(shape.d), rnd(shape.d), rnd(shape.dv), rnd(shape.dv)
    return Inputs(q.requires_grad_(rg), k.requires_grad_(rg), v.requires_grad_(rg), dout, rg)


@dataclass
class Built:
    forward: Callable[[], Tensor]  # computes the output in the impl's native layout
    leaves: list[Tensor]  # q, k, v the impl differentiates w.r.t. (q first)
    dout: Tensor  # upstream gradient in the impl's native layout
    bhsd: bool  # native layout is [b, h, s, d]


class Impl:
    name = "?"
    needs_cuda = False

    def context(self) -> ContextManager:
        return contextlib.nullcontext()

    def build(self, inp: Inputs, shape: Shape) -> Built:
        raise NotImplementedError


class IoAttn(Impl):
    """ioattn through its public function; ``backend`` 'auto' is what users get (the sm90 Gluon
    forward on Hopper where it covers the call), 'triton' the portable kernels."""

    def __init__(self, name: str = "ioattn", backend: str = "auto") -> None:
        self.name, self.backend = name, backend

    def build(self, inp: Inputs, shape: Shape) -> Built:
        func, (q, k, v) = get_ioattn_func(), (inp.q, inp.k, inp.v)
        backend, kw = self.backend, dict(causal=shape.causal)
        if shape.softcap:
            kw["softcap"] = shape.softcap
        return Built(lambda: func(q, k, v, backend=backend, **kw), [q, k, v], inp.dout, bhsd=False)


class IoAttnFp8(Impl):
    """ioattn's fp8 forward (``flash_attn_func`` on e4m3 q, k, v with descales): the cell's
    bf16 / fp16 inputs quantized once outside the timer (``ioattn.fp8.quantize_qkv``; block
    descales per 128 rows, or per (batch, head) with ``block_size=None``; V with its keys
    innermost, or as the cell's layout: ``v_keys_contiguous``), O in bf16. Forward only."""

    needs_cuda = True

    def __init__(self, name: str, block_size: Optional[int], v_keys_contiguous: bool = True) -> None:
        self.name, self.block_size, self.v_keys = name, block_size, v_keys_contiguous

    def build(self, inp: Inputs, shape: Shape) -> Built:
        if shape.mode != "fwd":
            raise ValueError("fp8 attention is forward only")
        from ioattn.fp8 import quantize_qkv

        func = get_ioattn_func()
        q8, k8, v8, qd, kd, vd = quantize_qkv(inp.q.detach(), inp.k.detach(), inp.v.detach(),
                                              block_size=self.block_size,
                                              v_keys_contiguous=self.v_keys)
        kw = dict(causal=shape.causal, q_descale=qd, k_descale=kd, v_descale=vd)
        if shape.softcap:
            kw["softcap"] = shape.softcap
        return Built(lambda: func(q8, k8, v8, **kw), [], inp.dout, bhsd=False)


class Sdpa(Impl):
    """torch's SDPA call on its own [b, h, s, d] tensors, through one of its backends
    (``backend_name``), or (None) through ioattn's ``scaled_dot_product_attention``: what a model
    written for torch's SDPA gets by changing the import (heads folded into the batch, read in
    place)."""

    def __init__(self, name: str, backend_name: Optional[str], needs_cuda: bool) -> None:
        self.name, self.backend_name, self.needs_cuda = name, backend_name, needs_cuda

    def context(self) -> ContextManager:
        if self.backend_name is None:
            return contextlib.nullcontext()
        # Entered once around build+timing rather than per call, to keep it out of the timer.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, self.backend_name))

    def build(self, inp: Inputs, shape: Shape) -> Built:
        if shape.softcap:
            raise ValueError("SDPA has no softcap: not timed in a --softcap run")
        if self.backend_name is None:
            from ioattn import scaled_dot_product_attention as sdpa
        else:
            sdpa = F.scaled_dot_product_attention
        q, k, v, dout = inp.bhsd()
        causal = shape.causal
        return Built(lambda: sdpa(q, k, v, is_causal=causal), [q, k, v], dout, True)


class Flex(Impl):
    name = "flex"
    needs_cuda = True
    _cache: dict[tuple, tuple[Callable[..., Tensor], object]] = {}

    def _compiled(self, shape: Shape, device: torch.device) -> tuple[Callable[..., Tensor], object,
                                                                     object]:
        """Compile once per problem. Dynamo is reset on a new problem so the grid never hits
        the recompile limit (which would silently fall back to eager flex, which is very slow)."""
        key = shape.data_key + (str(device),)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            self._cache.clear()
            torch._dynamo.reset()
            mask = None
            if shape.causal:
                mask = create_block_mask(
                    lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
                    B=None, H=None, Q_LEN=shape.s, KV_LEN=shape.s, device=device,
                )
            self._cache[key] = (torch.compile(flex_attention, dynamic=False), mask,
                                _softcap_mod(shape.softcap))
        return self._cache[key]

    def build(self, inp: Inputs, shape: Shape) -> Built:
        q, k, v, dout = inp.bhsd()
        fn, mask, mod = self._compiled(shape, q.device)
        return Built(lambda: fn(q, k, v, block_mask=mask, score_mod=mod), [q, k, v], dout, True)


def _softcap_mod(cap: float):
    """Flex's score_mod for softcap (scores arrive scaled), None without one."""
    if not cap:
        return None

    def mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return mod


IMPLS: dict[str, Impl] = {
    i.name: i
    for i in (
        IoAttn(),
        IoAttn("ioattn_triton", "triton"),
        IoAttn("ioattn_sm90", "sm90"),
        IoAttnFp8("ioattn_fp8", 128),
        IoAttnFp8("ioattn_fp8_head", None),
        IoAttnFp8("ioattn_fp8_vrows", 128, v_keys_contiguous=False),
        Sdpa("ioattn_sdpa", None, needs_cuda=False),
        Sdpa("sdpa_cudnn", "CUDNN_ATTENTION", needs_cuda=True),
        Sdpa("sdpa_flash", "FLASH_ATTENTION", needs_cuda=True),
        Flex(),
        Sdpa("sdpa_math", "MATH", needs_cuda=False),
    )
}
DEFAULT_IMPLS = ("ioattn", "ioattn_triton", "sdpa_cudnn", "sdpa_flash", "flex")
REF_ORDER = ("sdpa_cudnn", "sdpa_flash", "flex", "sdpa_math")  # preferred correctness reference


@dataclass
class Prepared:
    fn: Callable[[], object]  # the timed call
    out: Tensor  # forward output as [b, s, h, d] (a view), for the correctness check
    leaves: list[Tensor]  # grads set to None between timed calls
    to_bshd: Callable[[Tensor], Tensor]


def prepare(impl: Impl, inp: Inputs, shape: Shape) -> Prepared:
    """Build the timed callable. The first forward runs here so JIT/compile cost and shape
    refusals happen outside the timer; bwd times only out.backward on a graph built once."""
    built = impl.build(inp, shape)
    out = built.forward()
    to_bshd = (lambda t: t.transpose(1, 2)) if built.bhsd else (lambda t: t)
    if shape.mode == "fwd":
        return Prepared(built.forward, to_bshd(out), [], to_bshd)
    # empty_like keeps out's strides: some backends (cudnn) want dout strided like out.
    dout = torch.empty_like(out).copy_(built.dout)
    return Prepared(
        lambda: out.backward(dout, retain_graph=True), to_bshd(out.detach()), built.leaves, to_bshd
    )

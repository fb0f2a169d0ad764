"""torch.library ops of the dense family: schema, real impl (Triton launchers), fake impl, autograd.

``ioattn::dense_fwd`` and ``ioattn::dense_bwd`` serve both layouts: batched q [b, s_q, h, d]
(cu_seqlens None) and varlen q [total_q, h, d] with int32 cu_seqlens. Causal is ``window_right=0``.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Optional

import torch
from torch import Tensor

from ioattn.dense.params import check_int32_rows, make_params
from ioattn.dense.triton_bwd import attn_bwd
from ioattn.dense.triton_fwd import attn_fwd, keys_contiguous_layout
from ioattn.launch import keep

# fp8 inputs the forward takes (FlashAttention-3's: e4m3)
FP8_DTYPES = (torch.float8_e4m3fn,)
# Tests turn this on: outputs are filled with NaN before launch so unwritten elements show.
POISON_OUTPUTS = False
# The portable kernels' launches kept for repeats of a call's signature (``triton_fwd.attn_fwd``'s
# and ``triton_bwd.attn_bwd``'s ``key``): one C call a kernel with the call's addresses, past the
# config, the argument list and the launcher's per-call signature (~40-57 us of an eager
# forward's host time on the GPU machines, "launch_only" in results/tune/host_*.json; the
# backward launches three kernels). Batched calls without ALiBi or dropout only. On by default
# since its GPU tests passed on the H200 and an eager forward's host time fell from 73-113 to 32
# us there (the backward alone 243 -> 225 us: autograd's share dominates it;
# results/tune/host_overhead_4528809_nvidia-h200_2026-12-07.json); IOATTN_BIND=0 turns it off
# (and the op's keys for the sm90 forward's and backward's own kept launches, ``sm90_fwd.BIND``,
# ``sm90_bwd.BIND``)
BIND = os.environ.get("IOATTN_BIND", "1").lower() not in ("0", "false", "off")


def _new_output(like: Tensor, shape, dtype=None) -> Tensor:
    t = like.new_empty(shape, dtype=dtype)
    if POISON_OUTPUTS:
        t.fill_(float("nan"))
    return t


def _lse_shape(q: Tensor, varlen: bool) -> tuple[int, ...]:
    return (q.shape[-2], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _on_device(t: Tensor):
    # Triton launches on the current CUDA device, which need not be the inputs' device (the
    # device switch is skipped when it already is: entering it costs host time per call)
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


# (the call's scalars, each tensor's shape, strides, dtype, device) -> its AttnParams, for calls
# whose params hold no tensor: built (and the checks run) once per signature, not once per call
# (host time: benchmarks/NOTES.md, session 9). ``clear_memos`` empties it (tests that change a
# module switch between calls).
_MEMO: dict = {}


def _memo(scalars: tuple, tensors: tuple, build, with_key: bool = False):
    """The memoized ``build()`` for this signature (and, ``with_key``, the signature)."""
    key = (scalars, tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors))
    got = _MEMO.get(key)
    got = keep(_MEMO, key, build()) if got is None else got
    return (got, key) if with_key else got


def clear_memos() -> None:
    """Forget the memoized per-signature decisions of the dense entry points (``_MEMO`` here,
    ``api._PLANS``, the portable and sm90 kernels' kept launches): for code that
    changes a module-level switch (sm90_fwd.WG3, a preference rule...) between calls of one
    shape."""
    from ioattn.dense import api, triton_bwd, triton_fwd

    _MEMO.clear()
    api._PLANS.clear()
    triton_fwd._BOUND.clear()  # (kept launches keyed by _MEMO's signatures)
    triton_bwd._BOUND.clear()
    for name in ("sm90_fwd", "sm90_bwd"):  # (loaded with Gluon, when they were used)
        sm90 = sys.modules.get(f"ioattn.dense.{name}")
        if sm90 is not None:
            sm90._BOUND.clear()


def draw_rng_state(device: torch.device) -> Tensor:
    """Philox (seed, offset) for dropout, drawn from torch's generator of ``device``.

    Drawn as a tensor so torch.compile traces it and the op stays free of host syncs.
    """
    return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64, device=device)


def fwd_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
              cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
              softmax_scale: float, window_left: int, window_right: int, softcap: float,
              alibi_slopes: Optional[Tensor], dropout_p: float,
              rng_state: Optional[Tensor], impl: str = "triton", bwd_impl: str = "triton",
              deterministic: bool = False, q_descale: Optional[Tensor] = None,
              k_descale: Optional[Tensor] = None,
              v_descale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    # impl: the kernel family, 'triton' (portable) or 'sm90' (Gluon, Hopper), from ioattn.dispatch
    # (not named "kernel": inductor's fallback lowering takes that keyword itself); bwd_impl: the
    # family the registered autograd's backward runs and whether it must be bitwise reproducible
    # (both unused here). fp8 q, k, v (e4m3, forward only; the portable kernel, or the sm90
    # one where ``sm90_fwd.fp8_unsupported_reason`` allows): O in bf16, descales as
    # ``ioattn.flash_attn_func`` takes them
    fp8 = q.dtype in FP8_DTYPES
    d, d_v = q.shape[-1], v.shape[-1]
    d_pad = None  # (sm90) the head dim the kernels run at, when (d, d_v) are zero-padded to it
    if impl == "sm90":
        from ioattn.dense.sm90_fwd import attn_fwd_sm90 as launch
        from ioattn.dense.sm90_common import PADDED_HEAD_DIMS, aligned_base, padded_operands

        d_pad = PADDED_HEAD_DIMS.get((d, d_v))
        if d_pad is not None:
            (q, k, v), d_pad = padded_operands((("q", q), ("k", k), ("v", v)), d_pad,
                                               cu_seqlens_q is not None)
        q, k, v = (aligned_base(t) for t in (q, k, v))
    elif impl == "triton":
        launch = attn_fwd
    else:
        raise ValueError(f"impl={impl!r} is not 'triton' or 'sm90'")
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    if not (fp8 and keys_contiguous_layout(v)):  # (fp8 V may have its keys innermost)
        v = _last_dim_contiguous(v)
    out = _new_output(q, q.shape[:-1] + (v.shape[-1],), torch.bfloat16 if fp8 else None)
    varlen = cu_seqlens_q is not None
    lse = _new_output(q, _lse_shape(q, varlen), dtype=torch.float32)

    def params():
        if impl == "sm90":
            from ioattn.dense.sm90_fwd import fp8_unsupported_reason, unsupported_reason

            if fp8:
                reason = fp8_unsupported_reason(q, k, v, (q_descale, k_descale, v_descale),
                                                softcap, alibi_slopes is not None, dropout_p,
                                                varlen)
            else:
                reason = unsupported_reason(q, k, v, q.shape[-1], v.shape[-1], softcap,
                                            alibi_slopes is not None, dropout_p, varlen)
            if reason is not None:
                raise ValueError(f"impl='sm90' cannot run this call: {reason}")
        p = make_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, window_left, window_right, softcap, alibi_slopes,
                        dropout_p, rng_state,
                        (q_descale, k_descale, v_descale) if fp8 else None)
        check_int32_rows(p.max_seqlen_q, q=q, out=out)
        check_int32_rows(p.max_seqlen_k, k=k, v=v)
        return p

    bind_key = None
    if varlen or alibi_slopes is not None or rng_state is not None or fp8:
        p = params()  # params holding tensors: built each call
    else:
        p, key = _memo(("fwd", impl, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                        window_right, softcap, dropout_p), (q, k, v), params, with_key=True)
        if BIND:  # (out and lse are new allocations: their shapes, strides and alignment
            # follow from q's and v's; the sm90 forward adds its module's switches)
            bind_key = (key, tuple(t.data_ptr() % 16 == 0 for t in (q, k, v)))
    with _on_device(q):
        if bind_key is None:
            launch(p, q, k, v, out, lse)
        else:
            launch(p, q, k, v, out, lse, bind_key)
    if d_pad is not None:
        out = out[..., :d_v].contiguous()
    return out, lse


# the registered op (torch.compile graphs, opcheck, torch.ops.ioattn.dense_fwd); eager callers
# run ``fwd_impl`` itself: the dispatcher's per-call bookkeeping cost ~75 us of host time on the
# H200 machine (benchmarks/host_overhead.py), more than a short sequence's kernel
dense_fwd = torch.library.custom_op("ioattn::dense_fwd", fwd_impl, mutates_args=())


@dense_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
      window_right, softcap, alibi_slopes, dropout_p, rng_state, impl="triton", bwd_impl="triton",
      deterministic=False, q_descale=None, k_descale=None, v_descale=None):
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],),
                      dtype=torch.bfloat16 if q.dtype in FP8_DTYPES else q.dtype)
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)
    return out, lse


def bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              dlse: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
              max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int,
              window_right: int, softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float,
              rng_state: Optional[Tensor], impl: str = "triton",
              deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    d, d_v = q.shape[-1], v.shape[-1]
    d_pad = None  # (sm90) the head dim the kernels run at, when (d, d_v) are zero-padded to it
    if impl == "sm90":
        from ioattn.dense import sm90_bwd
        from ioattn.dense.sm90_common import (PADDED_HEAD_DIMS, aligned_base, padded_operands,
                                              tma_readable)

        # the fused form (default, sm90_bwd.FUSED) adds dQ by reductions: not for deterministic
        launch = functools.partial(sm90_bwd.attn_bwd_sm90, fused=sm90_bwd.FUSED and not deterministic)
        reason = sm90_bwd.unsupported_reason(q.shape[-1], v.shape[-1], softcap,
                                             alibi_slopes is not None, dropout_p)
        if reason is not None:
            raise ValueError(f"impl='sm90' cannot run this backward: {reason}")
        d_pad = PADDED_HEAD_DIMS.get((d, d_v))
        varlen = cu_seqlens_q is not None
        if d_pad is not None:  # as the forward ran (copies: O's zero columns too, for delta)
            (dout, q, k, v, out), d_pad = padded_operands(
                (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)), d_pad, varlen)
        else:
            dout = tma_readable("dout", dout, varlen)  # (an upstream transpose or expand)
        dout, q, k, v = (aligned_base(t) for t in (dout, q, k, v))
    elif impl == "triton":
        launch = attn_bwd
    else:
        raise ValueError(f"impl={impl!r} is not 'triton' or 'sm90'")
    dout, q, k, v, out = (_last_dim_contiguous(t) for t in (dout, q, k, v, out))
    if dlse is not None:
        dlse = dlse.contiguous()
    dq = _new_output(q, q.shape)
    dk = _new_output(k, k.shape)
    dv = _new_output(v, v.shape)
    delta = torch.empty_like(lse)

    def params():
        p = make_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, window_left, window_right, softcap, alibi_slopes,
                        dropout_p, rng_state)
        check_int32_rows(p.max_seqlen_q, q=q, out=out, dout=dout, dq=dq)
        check_int32_rows(p.max_seqlen_k, k=k, v=v, dk=dk, dv=dv)
        return p

    bind_key = None
    if cu_seqlens_q is not None or alibi_slopes is not None or rng_state is not None:
        p = params()
    else:
        p, key = _memo(("bwd", impl, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                        window_right, softcap, dropout_p), (dout, q, k, v, out), params,
                       with_key=True)
        if BIND:  # (dq / dk / dv and delta are new allocations: they follow from q, k, v and
            # LSE; the sm90 backward adds the fused form, its module's switches and the SM count)
            given = (dout, q, k, v, out, lse) if dlse is None else (dout, q, k, v, out, lse, dlse)
            bind_key = (key, lse.shape, lse.stride(), lse.dtype,
                        None if dlse is None else (dlse.shape, dlse.stride(), dlse.dtype),
                        tuple(t.data_ptr() % 16 == 0 for t in given))
    with _on_device(q):
        if bind_key is None:
            launch(p, dout, q, k, v, out, lse, dlse, dq, dk, dv, delta)
        else:
            launch(p, dout, q, k, v, out, lse, dlse, dq, dk, dv, delta, bind_key)
    if d_pad is not None:
        dq, dk, dv = dq[..., :d].contiguous(), dk[..., :d].contiguous(), dv[..., :d_v].contiguous()
    return dq, dk, dv


dense_bwd = torch.library.custom_op("ioattn::dense_bwd", bwd_impl, mutates_args=())


@dense_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
      impl="triton", deterministic=False):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_FWD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
             "softmax_scale", "window_left", "window_right", "softcap", "alibi_slopes", "dropout_p",
             "rng_state", "impl", "bwd_impl", "deterministic", "q_descale", "k_descale",
             "v_descale")


def _setup_context(ctx, inputs, output):
    args = dict(zip(_FWD_ARGS, inputs))
    out, lse = output
    ctx.save_for_backward(args["q"], args["k"], args["v"], out, lse, args["cu_seqlens_q"],
                          args["cu_seqlens_k"], args["alibi_slopes"], args["rng_state"])
    ctx.scalars = tuple(args[n] for n in ("max_seqlen_q", "max_seqlen_k", "softmax_scale",
                                          "window_left", "window_right", "softcap"))
    ctx.dropout_p = args["dropout_p"]
    ctx.bwd_impl = args.get("bwd_impl", "triton")
    ctx.deterministic = args.get("deterministic", False)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, bwd=None):
    # bwd: the backward's entry, the registered op unless the eager path passes ``bwd_impl``
    q, k, v, out, lse, cu_q, cu_k, alibi, rng = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    mq, mk, scale, wl, wr, cap = ctx.scalars
    dq, dk, dv = (bwd or dense_bwd)(dout, q, k, v, out, lse, dlse, cu_q, cu_k, mq, mk, scale, wl,
                                    wr, cap, alibi, ctx.dropout_p, rng, ctx.bwd_impl,
                                    ctx.deterministic)
    return (dq, dk, dv) + (None,) * (len(_FWD_ARGS) - 3)


def _needs_op(*tensors) -> bool:
    """Whether a call must go through the registered ops rather than their implementations: while
    torch.compile (or compiled autograd) traces, under a dispatch mode (selective activation
    checkpointing, FlopCounterMode, make_fx) or the JIT tracer, and for tensor subclasses
    (FakeTensor, DTensor...) and torch.func's wrapped tensors, which must see
    ``ioattn::dense_fwd`` / ``dense_bwd`` as ops."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch.jit.is_tracing()
            or any(type(t) not in (Tensor, torch.nn.Parameter)
                   or torch._C._functorch.is_functorch_wrapped_tensor(t)  # torch.func transforms
                   for t in tensors if t is not None))


dense_fwd.register_autograd(_backward, setup_context=_setup_context)


class DenseAttention(torch.autograd.Function):
    """The public functions' eager entry when a gradient is needed: the registered op's
    implementations and backward, without the custom-op autograd wrapper's per-call argument
    handling or the dispatcher (host time per call on the CI CPU, kernels stubbed out: 125 -> 87
    us for the wrapper; the dispatcher another ~75 us on the H200 machine, each direction)."""

    # forward(ctx, ...) rather than a separate setup_context: with one, Function.apply binds the
    # arguments through inspect.signature on every call (~20 us of host time on the CI CPU). The
    # functorch transforms that need setup_context take the registered op instead (_needs_op)
    @staticmethod
    def forward(ctx, *inputs):
        output = fwd_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        if torch.is_grad_enabled():  # create_graph=True: the backward kernels have no gradient
            raise RuntimeError("ioattn attention has no double backward (create_graph=True through "
                               "it): its backward kernels are not differentiable")
        return _backward(ctx, dout, dlse, dense_bwd if _needs_op(dout, dlse) else bwd_impl)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
                    cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                    softmax_scale: float, window_left: int, window_right: int, softcap: float,
                    alibi_slopes: Optional[Tensor], dropout_p: float,
                    rng_state: Optional[Tensor], impl: str = "triton",
                    bwd_impl: str = "triton", deterministic: bool = False,
                    descales: Optional[tuple] = None) -> tuple[Tensor, Tensor]:
    """Differentiable (out, lse); arguments as ``ioattn::dense_fwd``. ``bwd_impl`` picks the
    backward's kernels independently of the forward's (both keep the same LSE convention).
    descales: an fp8 call's (q_descale, k_descale, v_descale) (forward only)."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, impl, bwd_impl,
            deterministic)
    if descales is not None:
        args = args + tuple(descales)
    # compiled graphs, dispatch modes and tracers use the registered op and its autograd (dynamo
    # traces it without a break; it cannot trace autograd.Function.apply with one tensor in two
    # inputs, e.g. cu_seqlens_q is cu_seqlens_k)
    if _needs_op(q, k, v):
        return dense_fwd(*args)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return fwd_impl(*args)
    return DenseAttention.apply(*args)

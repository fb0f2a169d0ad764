"""Public dense attention functions with FlashAttention-2 signatures and semantics.

Switching from flash_attn is a change of import: ``from ioattn import flash_attn_func``.
Differences from FA2, all additive: a keyword-only ``backend`` ('auto' | 'sm90' | 'triton' | 'reference'),
head dims 1..256 with d_v != d allowed, gradients through the returned LSE, and
``return_attn_probs=True`` returning ``(out, lse, None)`` (no materialized probability matrix).
"""
from __future__ import annotations

import math
import weakref
from typing import Optional, Sequence

import torch
from torch import Tensor

from ioattn.dense.op import FP8_DTYPES, dense_attention, draw_rng_state
from ioattn.dense.triton_fwd import FP8_BLOCK as QUANT_BLOCK
from ioattn.dispatch import resolve_backend, sm90_unavailable_reason
from ioattn.launch import keep
from ioattn.reference import attention_ref, attention_varlen_ref

_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def _fail(msg: str, exc=ValueError):
    raise exc(msg)


def _check_tensor(name: str, t, rank: int) -> None:
    if not isinstance(t, Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.dim() != rank:
        _fail(f"{name} must have {rank} dims, got shape {tuple(t.shape)}")


def _check_common(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, window_size, softcap: float,
                  softmax_scale, fp8_ok: bool = False, kv_dtype=None) -> None:
    """kv_dtype: k's and v's dtype where it may differ from q's (an fp8 KV cache under a
    16-bit q, checked by the caller); default q's."""
    if q.dtype not in _DTYPES and not (fp8_ok and q.dtype in FP8_DTYPES):
        _fail(f"q has dtype {q.dtype}; ioattn supports torch.float16 and torch.bfloat16 "
              f"(cast with q.to(torch.bfloat16)); flash_attn_func / flash_attn_varlen_func also "
              f"take torch.float8_e4m3fn (with descales)", TypeError)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != (kv_dtype or q.dtype):
            _fail(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share a dtype",
                  TypeError)
        if t.device != q.device:
            _fail(f"{name} is on {t.device} but q is on {q.device}; put q, k, v on one device")
    d, d_v = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d:
        _fail(f"k head dim {k.shape[-1]} != q head dim {d}; q and k must share the head dim")
    for name, dim in (("q/k", d), ("v", d_v)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            _fail(f"{name} head dim {dim} is not supported: it must be in 1..{MAX_HEAD_DIM}")
    h, h_k = q.shape[-2], k.shape[-2]
    if v.shape[-2] != h_k:
        _fail(f"v has {v.shape[-2]} heads but k has {h_k}; k and v must share the KV head count")
    if h_k == 0 or h % h_k != 0:
        _fail(f"q heads ({h}) must be a multiple of k/v heads ({h_k}) for GQA/MQA")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        _fail(f"dropout_p={dropout_p!r} must be a float in [0, 1)")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window_size)):
        _fail(f"window_size={window_size!r} must be (left, right) ints >= -1 (-1: unbounded)")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        _fail(f"softcap={softcap!r} must be a float >= 0 (0 disables it)")
    if softmax_scale is not None and (not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        _fail(f"softmax_scale={softmax_scale!r} must be a finite float > 0, or None (1/sqrt(headdim))")


def _check_alibi(alibi_slopes, batch: int, h: int, device: torch.device) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, Tensor):
        _fail("alibi_slopes must be a torch.Tensor of shape (nheads,) or (batch, nheads)", TypeError)
    if alibi_slopes.dtype != torch.float32:
        _fail(f"alibi_slopes must be float32, got {alibi_slopes.dtype} (use .float())", TypeError)
    if tuple(alibi_slopes.shape) not in ((h,), (batch, h)):
        _fail(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected ({h},) or ({batch}, {h})")
    if alibi_slopes.device != device:
        _fail(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")


class Validated:
    """Index tensors whose values were checked on the host, with their version counters: a
    model's layers pass the same cu_seqlens (or a decode loop's the same cache_seqlens /
    block_table) until they are updated in place (which bumps the version) or replaced, so the
    host sync of the check happens once per step instead of once per layer, as with FlashInfer's
    plan(). Weak references: a new tensor that reuses a freed one's address is checked again.
    Writes that bypass torch's version counter (a custom kernel, a CUDA graph replay) are not
    seen; the kernels never address outside their tensors whatever the values."""

    def __init__(self, size: int = 16):
        self.size = size
        self.entries: list[tuple] = []

    @staticmethod
    def _state(tensors, params):
        return tuple(t._version if t is not None else None for t in tensors), params

    def seen(self, tensors, params) -> bool:
        state = self._state(tensors, params)
        for refs, st in self.entries:
            if st == state and all((r is None and t is None) or (r is not None and r() is t)
                                   for r, t in zip(refs, tensors)):
                return True
        return False

    def add(self, tensors, params) -> None:
        refs = tuple(weakref.ref(t) if t is not None else None for t in tensors)
        self.entries = [(refs, self._state(tensors, params))] + self.entries[:self.size - 1]


VALIDATED = Validated()


def skip_value_checks(t: Tensor) -> bool:
    """Host-side value checks (a sync) are skipped while compiling and under CUDA graph capture."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _check_cu_seqlens(name: str, cu: Tensor, total: int, max_seqlen: int, batch: Optional[int],
                      device: torch.device, values: bool = True) -> None:
    if not isinstance(cu, Tensor):
        _fail(f"{name} must be a torch.Tensor (int32, shape (batch + 1,))", TypeError)
    if cu.dtype != torch.int32:
        _fail(f"{name} must be int32, got {cu.dtype} (use .to(torch.int32))", TypeError)
    if cu.dim() != 1 or cu.shape[0] < 1 or (batch is not None and cu.shape[0] != batch + 1):
        want = "(batch + 1,)" if batch is None else f"({batch + 1},) like cu_seqlens_q"
        _fail(f"{name} must have shape {want}, got {tuple(cu.shape)}")
    if cu.device != device:
        _fail(f"{name} is on {cu.device} but q is on {device}")
    if not isinstance(max_seqlen, int) or max_seqlen < 0:
        _fail(f"max_seqlen for {name} must be an int >= 0, got {max_seqlen!r}")
    params = (name, total, max_seqlen)
    if not values or skip_value_checks(cu) or VALIDATED.seen((cu,), params):
        return  # value checks need a host sync: once per state of the tensor (``Validated``)
    _check_cu_values(name, cu.tolist(), total, max_seqlen)
    VALIDATED.add((cu,), params)


def _check_cu_values(name: str, vals: list, total: int, max_seqlen: int) -> None:
    """``_check_cu_seqlens``' checks of the values (read back to the host)."""
    lens = [b - a for a, b in zip(vals, vals[1:])]
    if vals[0] != 0 or any(n < 0 for n in lens):
        _fail(f"{name} must start at 0 and be non-decreasing, got {vals[:8]}...")
    if vals[-1] > total:
        _fail(f"{name}[-1] = {vals[-1]} exceeds the {total} rows of the packed tensor")
    if lens and max(lens) > max_seqlen:
        _fail(f"a sequence in {name} has length {max(lens)} > max_seqlen {max_seqlen}; pass the true max")


def _window(causal: bool, window_size: Sequence[int]) -> tuple[int, int]:
    left, right = int(window_size[0]), int(window_size[1])
    return left, 0 if causal else right


def _pick(backend: str, q: Tensor, k: Tensor, v: Tensor, softcap: float,
          alibi_slopes: Optional[Tensor], dropout_p: float, varlen: bool, masked: bool,
          max_seqlen_q: int, max_seqlen_k: int, windowed: bool = False,
          descales: tuple = (None, None, None)) -> tuple[str, str]:
    """The kernel families of this call's forward and backward: 'sm90', 'triton' or 'reference'
    (ioattn.dispatch). 'auto' picks each direction where it measured faster; an explicit 'sm90'
    raises when either direction it would have to run is not covered. fp8 inputs (forward
    only; their descales) run the sm90 forward where it covers them
    (``sm90_fwd.fp8_unsupported_reason``) and measured faster (``fp8_preferred``), else the
    portable kernel."""
    if q.dtype in FP8_DTYPES:
        def fp8_problem():
            from ioattn.dense.sm90_fwd import fp8_unsupported_reason

            return fp8_unsupported_reason(q, k, v, descales, softcap, alibi_slopes is not None,
                                          dropout_p, varlen)

        def fp8_preferred():
            from ioattn.dense.sm90_fwd import fp8_preferred

            return fp8_preferred(q.shape[-1], max_seqlen_q)

        impl = resolve_backend(backend, q.device, fp8_problem, fp8_preferred)
        return impl, "triton" if impl == "sm90" else impl
    problem = []  # sm90_problem's answer, asked at most once

    def sm90_problem():
        if not problem:
            from ioattn.dense.sm90_fwd import unsupported_reason

            problem.append(unsupported_reason(q, k, v, q.shape[-1], v.shape[-1], softcap,
                                              alibi_slopes is not None, dropout_p, varlen))
        return problem[0]

    backward = []  # (why the sm90 backward does not cover the call, whether 'auto' prefers it)

    def sm90_backward():
        if not backward:
            from ioattn.dense import sm90_bwd

            reason = sm90_bwd.unsupported_reason(q.shape[-1], v.shape[-1], softcap,
                                                 alibi_slopes is not None, dropout_p)
            backward.append((reason, reason is None and sm90_bwd.preferred(
                q.shape[-1], masked, max_seqlen_k, softcap, v.shape[-1], varlen, max_seqlen_q,
                windowed)))
        return backward[0]

    def sm90_preferred():
        from ioattn.dense import sm90_fwd

        # softcap: the families' tanh differ (the sm90 kernels' tanh.approx, the portable exact
        # one) and a backward recomputes P against the forward's LSE, so 'auto' runs both
        # directions in one family: the sm90 forward only where the sm90 backward is taken too
        return (sm90_fwd.preferred(q.shape[-1], masked, max_seqlen_q, max_seqlen_k, varlen,
                                   softcap, v.shape[-1], windowed)
                and (softcap == 0 or sm90_backward()[1]))

    fwd = resolve_backend(backend, q.device, sm90_problem, sm90_preferred)
    if fwd == "reference" or backend == "triton" or sm90_unavailable_reason(q.device) is not None \
            or sm90_problem() is not None:
        return fwd, fwd if fwd == "reference" else "triton"
    reason, bwd_preferred = sm90_backward()
    if reason is None and (backend == "sm90"
                           or (bwd_preferred and (softcap == 0 or fwd == "sm90"))):  # (one family)
        return fwd, "sm90"
    if backend == "sm90" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        _fail(f"backend='sm90' cannot run this call's backward: {reason}; pass backend='auto' (the "
              f"sm90 forward with the portable backward) or backend='triton'")
    return fwd, "triton"


# a batched call's signature -> the dense_attention arguments its checks and backend pick gave:
# repeated calls of one signature (every layer of a model, every step) skip them (host time:
# benchmarks/NOTES.md, session 9). The signature holds everything the checks and the pick read;
# calls with ALiBi, a sink or dropout are not memoized. ``op.clear_memos`` empties it.
_PLANS: dict = {}


def _plan_key(q, k, v, *scalars):
    """The signature of a batched call (None when it has none: while torch.compile traces, for a
    tensor subclass). It may not hash (a window_size list): ``_plan`` says so."""
    if (torch.compiler.is_compiling() or type(q) is not Tensor or type(k) is not Tensor
            or type(v) is not Tensor):
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # scalars by type and value: the checks reject (-1.0, -1.0) windows or numpy floats, which
    # compare (and hash) equal to the ints and floats of a valid call
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
           v.dtype, q.device, k.device, v.device, grad,
           tuple((type(x), tuple((type(w), w) for w in x) if type(x) is tuple else x)
                 for x in scalars))
    return key


def _plan(key):
    """(the plan kept for key or None, key or None when it does not hash)."""
    if key is None:
        return None, None
    try:
        return _PLANS.get(key), key
    except TypeError:  # an unhashable argument: no signature
        return None, None


def _check_sink(sink, h: int, device: torch.device) -> None:
    if sink is None:
        return
    if not isinstance(sink, Tensor):
        _fail(f"learnable_sink must be a tensor [nheads={h}], got {type(sink).__name__}", TypeError)
    if tuple(sink.shape) != (h,):
        _fail(f"learnable_sink must be [nheads={h}] (one logit per query head), got "
              f"{tuple(sink.shape)}")
    if not sink.is_floating_point():
        _fail(f"learnable_sink must be a float tensor, got {sink.dtype}", TypeError)
    if sink.device != device:
        _fail(f"learnable_sink is on {sink.device} but q is on {device}")


def _with_sink(out: Tensor, lse: Tensor, sink: Optional[Tensor], varlen: bool):
    """Attention sinks (gpt-oss): one extra logit per head in each row's softmax, with no value.
    From the attention over the keys (out, natural-log lse): lse' = log(e^lse + e^sink) and out'
    = out * e^(lse - lse'). Plain differentiable ops on top of the kernels' (out, lse), so every
    backend and the backward (through the LSE) carry it, and the sink gets its gradient."""
    if sink is None:
        return out, lse
    s = sink.float().view(-1, 1) if varlen else sink.float().view(1, -1, 1)  # lse's layout
    lse_s = torch.logaddexp(lse, s)
    r = torch.exp(lse - lse_s)  # the keys' share of the softmax
    r = r.t() if varlen else r.transpose(1, 2)  # out's layout: [.., seqlen, nheads]
    return (out.float() * r[..., None]).to(out.dtype), lse_s


def _finish(out: Tensor, lse: Tensor, return_attn_probs: bool, sink: Optional[Tensor] = None,
            varlen: bool = False):
    out, lse = _with_sink(out, lse, sink, varlen)
    return (out, lse, None) if return_attn_probs else out


def check_descale_tensor(name: str, t, device: torch.device) -> None:
    """A descale's type, dtype and device (its shape is the caller's)."""
    if not isinstance(t, Tensor):
        _fail(f"{name} must be a float32 tensor or None, got {type(t).__name__}", TypeError)
    if t.dtype != torch.float32:
        _fail(f"{name} must be float32, got {t.dtype} (use .float())", TypeError)
    if t.device != device:
        _fail(f"{name} is on {t.device} but q is on {device}")


def _check_fp8(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, descales: tuple,
               backend: str, batch: int, seqlens: tuple[int, int]) -> None:
    """An fp8 call's own rules (after ``_check_common``): forward only, no dropout, descales'
    dtypes and shapes; inputs that are not fp8 take no descales."""
    names = ("q_descale", "k_descale", "v_descale")
    if q.dtype not in FP8_DTYPES:
        for name, t in zip(names, descales):
            if t is not None:
                _fail(f"{name} applies to fp8 inputs (torch.float8_e4m3fn) only; q is {q.dtype}")
        return
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        _fail("fp8 attention is forward only (as FlashAttention-3's fp8 path): no gradients flow "
              "to fp8 q, k, v; run the training pass in bf16 or fp16")
    if dropout_p:
        _fail(f"dropout_p={dropout_p!r}: fp8 attention has no dropout (pass 0.0)")
    if q.is_cuda and backend != "reference" and torch.cuda.get_device_capability(q.device) < (8, 9):
        _fail(f"fp8 attention needs fp8 tensor cores (sm_89 or newer: Ada, Hopper); "
              f"{torch.cuda.get_device_name(q.device)} has none: pass bf16 or fp16 (or "
              f"backend='reference')")
    h, h_k = q.shape[-2], k.shape[-2]
    for name, t, heads, s in zip(names, descales, ((h, h_k), (h_k,), (h_k,)),
                                 (seqlens[0], seqlens[1], seqlens[1])):
        if t is None:
            continue
        check_descale_tensor(name, t, q.device)
        blocks = max(1, -(-s // QUANT_BLOCK))
        if not (t.dim() in (2, 3) and t.shape[0] == batch and t.shape[1] in heads
                and (t.dim() == 2 or t.shape[2] == 1 or t.shape[2] >= blocks)):
            _fail(f"{name} has shape {tuple(t.shape)}; expected (batch={batch}, heads) or "
                  f"(batch, heads, >= {blocks}) (one descale per {QUANT_BLOCK} rows: "
                  f"ioattn.fp8.quantize), heads {' or '.join(map(str, sorted(set(heads))))}")


def _dequantized(q: Tensor, k: Tensor, v: Tensor, descales: tuple, cu_seqlens_q=None,
                 cu_seqlens_k=None) -> tuple[Tensor, Tensor, Tensor]:
    """The 'reference' backend's fp8 inputs: q, k, v times their descales, in fp32."""
    from ioattn.fp8 import dequantize

    return tuple(dequantize(t, ds, cu_seqlens=cu, dtype=torch.float32)
                 for t, ds, cu in zip((q, k, v), descales,
                                      (cu_seqlens_q, cu_seqlens_k, cu_seqlens_k)))


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, learnable_sink: Optional[Tensor] = None,
                    q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
                    v_descale: Optional[Tensor] = None, backend: str = "auto"):
    """Attention over batched sequences (FlashAttention-2 semantics).

    Args:
        q: [batch, seqlen_q, nheads, headdim], fp16 or bf16.
        k: [batch, seqlen_k, nheads_k, headdim]; nheads % nheads_k == 0 (GQA/MQA).
        v: [batch, seqlen_k, nheads_k, headdim_v]; headdim, headdim_v in 1..256.
        dropout_p: dropout probability on the attention matrix (Philox, from torch's generator).
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: causal mask, aligned to the bottom-right corner when seqlen_q != seqlen_k.
        window_size: (left, right) sliding window, -1 = unbounded side.
        softcap: if > 0, scores become softcap * tanh(scores / softcap).
        alibi_slopes: fp32 (nheads,) or (batch, nheads); adds -slope * |i + seqlen_k - seqlen_q - j|.
        deterministic: a bitwise-reproducible backward. The portable backward kernels have no
            atomics and always are; the sm90 backward adds dQ by TMA reductions (their order
            varies) and runs its two-kernel form, without atomics, when this is True.
        return_attn_probs: also return the LSE: (out, softmax_lse [b, nheads, seqlen_q] fp32,
            natural log, None).
        learnable_sink: [nheads] float, attention sinks (gpt-oss; FlashAttention's name): one
            extra logit per head in every row's softmax, with no value and no mask; the LSE
            includes it, and it gets a gradient when it requires one.
        q_descale, k_descale, v_descale: fp8 inputs (q, k, v all torch.float8_e4m3fn,
            FlashAttention-3's fp8 forward): fp32 descales, x = x_fp8 * descale; None (1),
            [batch, nheads_k] (FlashAttention-3's form; q's may also be [batch, nheads]), or
            [batch, heads, ceil(seqlen / 128)] (block quantization; ``ioattn.fp8.quantize``
            makes them). The output is bf16, the LSE natural log over the descaled scores. Forward
            only (no gradients, no dropout), on the portable kernels ('auto' / 'triton') or
            'reference'; sm_89+ GPUs (Ada, Hopper). On Hopper, batched calls with per-head
            descales run the sm90 fp8 forward ('auto' where it measured faster, 'sm90').
        backend: 'auto' (default: 'sm90' on Hopper where it covers the call, else 'triton'),
            'sm90' (the Gluon FA3-design kernels, forward and backward, d = d_v in {64, 128,
            256}, and (d, d_v) = (96, 96), (192, 192), (192, 128) zero-padded; it raises for
            what they do not cover, e.g. ALiBi, or softcap with a gradient at d >= 192),
            'triton' (portable Triton kernels) or 'reference' (plain PyTorch). A requested
            backend that cannot run the call raises ValueError. 'auto' picks the forward's and
            the backward's kernels separately.

    Returns:
        out [batch, seqlen_q, nheads, headdim_v], or the tuple above.
    """
    key = None
    descales = (q_descale, k_descale, v_descale)
    # (`is None` each: torch 2.11's dynamo cannot trace a tuple holding tensors compared by ==)
    if (alibi_slopes is None and learnable_sink is None and dropout_p == 0
            and all(t is None for t in descales)):
        plan, key = _plan(_plan_key(q, k, v, dropout_p, softmax_scale, causal, window_size,
                                    softcap, deterministic, backend))
        if plan is not None:  # a signature seen before: its checks passed, its pick holds
            out, lse = dense_attention(q, k, v, None, None, *plan)
            return (out, lse, None) if return_attn_probs else out
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4)
    _check_common(q, k, v, dropout_p, window_size, softcap, softmax_scale, fp8_ok=True)
    b, s_q, h, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        _fail(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if v.shape[1] != k.shape[1]:
        _fail(f"k has seqlen {k.shape[1]} but v has {v.shape[1]}; they must match")
    _check_alibi(alibi_slopes, b, h, q.device)
    _check_sink(learnable_sink, h, q.device)
    _check_fp8(q, k, v, dropout_p, descales, backend, b, (s_q, k.shape[1]))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    left, right = _window(causal, window_size)
    fp8 = q.dtype in FP8_DTYPES
    impl, bwd_impl = _pick(backend, q, k, v, softcap, alibi_slopes, dropout_p, varlen=False,
                           masked=left >= 0 or right >= 0, max_seqlen_q=s_q,
                           max_seqlen_k=k.shape[1], windowed=left >= 0 or right > 0,
                           descales=descales)
    if impl == "reference":
        mask = None
        if dropout_p > 0:
            mask = torch.rand(b, h, s_q, k.shape[1], device=q.device) >= dropout_p
        if fp8:
            q, k, v = _dequantized(q, k, v, descales)
        out, lse = attention_ref(q, k, v, window_size=(left, right), softcap=softcap,
                                 alibi_slopes=alibi_slopes, softmax_scale=scale,
                                 dropout_p=dropout_p, dropout_mask=mask)
        out = out.to(torch.bfloat16) if fp8 else out
        return _finish(out, lse, return_attn_probs, learnable_sink)
    rng = draw_rng_state(q.device) if dropout_p > 0 else None
    plan = (s_q, k.shape[1], float(scale), left, right, float(softcap), alibi_slopes,
            float(dropout_p), rng, impl, bwd_impl, bool(deterministic))
    if key is not None:  # (fp8 without descales too: its plan replays without them)
        keep(_PLANS, key, plan)
    out, lse = dense_attention(q, k, v, None, None, *plan, descales=descales if fp8 else None)
    return _finish(out, lse, return_attn_probs, learnable_sink)


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                           causal: bool = False, window_size: Sequence[int] = (-1, -1),
                           softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: Optional[Tensor] = None, *,
                           seqused_k: Optional[Tensor] = None,
                           learnable_sink: Optional[Tensor] = None,
                           q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
                           v_descale: Optional[Tensor] = None, backend: str = "auto"):
    """Attention over packed variable-length sequences (FlashAttention-2 semantics).

    q [total_q, nheads, headdim], k [total_k, nheads_k, headdim], v [total_k, nheads_k, headdim_v];
    cu_seqlens_q / cu_seqlens_k int32 (batch + 1,) prefix sums (zero-length sequences allowed);
    max_seqlen_* are the longest lengths. LSE (with return_attn_probs) is [nheads, total_q] fp32,
    natural log. Other arguments as ``flash_attn_func``.

    block_table: int32 [batch, max_pages_per_seq] (FlashAttention's paged varlen call, as vLLM
    makes it): k and v are then paged caches [num_pages, page_size, nheads_k, headdim], any page
    size >= 1, and sequence i's keys are the first cu_seqlens_k[i + 1] - cu_seqlens_k[i] slots
    of its pages (causal aligns its queries with the last ones). They are copied into packed
    K/V of batch * max_seqlen_k rows (``ioattn.decode.op.gather_pages``, no host sync), then the
    varlen kernels run; where those would exceed ``decode.op.PAGED_VARLEN_MAX_BYTES`` (1 GiB),
    calls without ALiBi and without q's gradient attend over the pages instead
    (``paged_varlen_attn``). Forward only: the caches get no gradients, and caches that require
    them are refused (dropout is refused too).

    seqused_k: int32 (batch,), with block_table and cu_seqlens_k=None passed explicitly
    (FlashAttention-3's form of the paged call): sequence i's keys are the first seqused_k[i]
    slots of its pages. Read on the device (its prefix sum stands in for cu_seqlens_k); its
    values are checked on the host once per state of the tensor. FA3's other arguments (out,
    seqused_q, num_splits, scheduler_metadata) are not taken.

    q_descale, k_descale, v_descale: fp8 q, k, v (torch.float8_e4m3fn), as ``flash_attn_func``;
    batch is the number of sequences, block descales count max_seqlen's blocks from each
    sequence's start (``ioattn.fp8.quantize(x, cu_seqlens=...)``). Not with block_table.
    """
    descales = (q_descale, k_descale, v_descale)
    if (any(t is not None for t in descales) or q.dtype in FP8_DTYPES) and block_table is not None:
        _fail("fp8 inputs / descales are not taken with block_table (paged K/V): pass packed "
              "K/V (cu_seqlens_k) or bf16 / fp16 pages")
    if seqused_k is not None:
        cu_seqlens_k = _cu_from_seqused(seqused_k, cu_seqlens_k, block_table, cu_seqlens_q,
                                        max_seqlen_k, q)
    if block_table is not None:
        packed = _paged_keys(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, block_table,
                             dropout_p, window_size, softcap, softmax_scale, alibi_slopes, backend,
                             seqused_k)
        if packed is None:  # packed K/V would be too large: attention over the pages
            return _paged_direct(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                                 softmax_scale, causal, window_size, softcap, return_attn_probs,
                                 learnable_sink)
        k, v = packed
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 3)
    _check_common(q, k, v, dropout_p, window_size, softcap, softmax_scale, fp8_ok=True)
    if v.shape[0] != k.shape[0]:
        _fail(f"k has {k.shape[0]} rows but v has {v.shape[0]}; they must match")
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, None, q.device)
    batch = cu_seqlens_q.shape[0] - 1
    # (a prefix sum of seqused_k: its values were checked through seqused_k's)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, batch, q.device,
                      values=seqused_k is None)
    h, d = q.shape[1], q.shape[2]
    _check_alibi(alibi_slopes, batch, h, q.device)
    _check_sink(learnable_sink, h, q.device)
    _check_fp8(q, k, v, dropout_p, descales, backend, batch, (int(max_seqlen_q), int(max_seqlen_k)))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    left, right = _window(causal, window_size)
    fp8 = q.dtype in FP8_DTYPES
    impl, bwd_impl = _pick(backend, q, k, v, softcap, alibi_slopes, dropout_p, varlen=True,
                           masked=left >= 0 or right >= 0, max_seqlen_q=int(max_seqlen_q),
                           max_seqlen_k=int(max_seqlen_k), windowed=left >= 0 or right > 0,
                           descales=descales)
    if impl == "reference":
        if fp8:
            q, k, v = _dequantized(q, k, v, descales, cu_seqlens_q, cu_seqlens_k)
        masks = None
        if dropout_p > 0:
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            masks = [torch.rand(h, cq[i + 1] - cq[i], ck[i + 1] - ck[i], device=q.device) >= dropout_p
                     for i in range(batch)]
        out, lse = attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, window_size=(left, right),
                                        softcap=softcap, alibi_slopes=alibi_slopes,
                                        softmax_scale=scale, dropout_p=dropout_p, dropout_mask=masks)
        if out.shape[0] < q.shape[0]:  # rows past cu_seqlens_q[-1] are outside every sequence
            out = torch.cat([out, out.new_zeros((q.shape[0] - out.shape[0],) + out.shape[1:])])
            lse = torch.cat([lse, lse.new_full((h, q.shape[0] - lse.shape[1]), float("-inf"))], 1)
        out = out.to(torch.bfloat16) if fp8 else out
        return _finish(out, lse, return_attn_probs, learnable_sink, varlen=True)
    rng = draw_rng_state(q.device) if dropout_p > 0 else None
    out, lse = dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                               int(max_seqlen_k), float(scale), left, right, float(softcap),
                               alibi_slopes, float(dropout_p), rng, impl, bwd_impl,
                               bool(deterministic), descales=descales if fp8 else None)
    return _finish(out, lse, return_attn_probs, learnable_sink, varlen=True)


def _check_index(name: str, t, shape: tuple, device: torch.device, doc: str | None = None) -> None:
    """An int32 index tensor of ``shape`` on q's device (``doc``: the shape as the message says
    it, e.g. "(batch,) = (4,)")."""
    doc = doc or str(shape)
    if not isinstance(t, Tensor):
        _fail(f"{name} must be a torch.Tensor of int32, shape {doc}", TypeError)
    if t.dtype != torch.int32:
        _fail(f"{name} must be int32, got {t.dtype} (use .to(torch.int32))", TypeError)
    if tuple(t.shape) != tuple(shape):
        _fail(f"{name} must have shape {doc}, got {tuple(t.shape)}")
    if t.device != device:
        _fail(f"{name} is on {t.device} but q is on {device}")


def _paged_batch(cu_seqlens_q) -> int:
    """(a paged varlen call) The batch size from cu_seqlens_q's shape (its values: later)."""
    if not isinstance(cu_seqlens_q, Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        _fail("cu_seqlens_q must be an int32 tensor of shape (batch + 1,)", TypeError
              if not isinstance(cu_seqlens_q, Tensor) else ValueError)
    return cu_seqlens_q.shape[0] - 1


def _cu_from_seqused(seqused_k, cu_seqlens_k, block_table, cu_seqlens_q, max_seqlen_k: int,
                     q) -> Tensor:
    """(``flash_attn_varlen_func``) cu_seqlens_k of a paged call that gives seqused_k: its prefix
    sum, made on the device every call (a kept copy would go stale under writes that bypass the
    version counter, such as a graph replay's); the values of seqused_k are checked on the host
    once per state (``Validated``), as the paged call's checks are keyed on it."""
    if block_table is None:
        _fail("seqused_k is supported with block_table (paged caches); with packed k / v, pack "
              "only the keys each sequence uses and pass their cu_seqlens_k, or pass block_table")
    if cu_seqlens_k is not None:
        _fail("with block_table, pass cu_seqlens_k or seqused_k, not both (seqused_k gives "
              "each sequence's key count; pass cu_seqlens_k=None)")
    _check_tensor("q", q, 3)
    batch = _paged_batch(cu_seqlens_q)
    _check_index("seqused_k", seqused_k, (batch,), q.device,
                 f"(batch,) = ({batch},), cu_seqlens_q's length minus one")
    params = ("seqused_k", max_seqlen_k)
    if not skip_value_checks(seqused_k) and not VALIDATED.seen((seqused_k,), params):
        for i, n in enumerate(seqused_k.tolist()):
            if n < 0 or n > max_seqlen_k:
                _fail(f"seqused_k[{i}] = {n} must be in [0, max_seqlen_k={max_seqlen_k}]")
        VALIDATED.add((seqused_k,), params)
    return torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))


def _paged_keys(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                max_seqlen_k: int, block_table: Tensor, dropout_p: float, window_size,
                softcap: float, softmax_scale, alibi_slopes: Optional[Tensor],
                backend: str, seqused_k: Optional[Tensor] = None) -> Optional[tuple[Tensor, Tensor]]:
    """(``flash_attn_varlen_func`` with block_table) the checks of the paged caches and table,
    then the keys packed as the varlen kernels read them: [batch * capacity, nheads_k, d],
    capacity = ``decode.op.paged_capacity`` (max_seqlen_k, at most a table row's slots); or
    None where the call attends over the pages instead (``decode.op.paged_varlen_copies``)."""
    from ioattn.decode import op as decode_op  # (decode.op imports this module)

    _check_tensor("q", q, 3)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            _fail(f"with block_table, {name} must be a paged cache [num_pages, page_size, nheads_k, "
                  f"headdim], got {tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}",
                  TypeError if not isinstance(t, Tensor) else ValueError)
        if t.stride(-1) != 1:
            _fail(f"{name} (a paged cache) must have a contiguous last dim")
    _check_common(q, k, v, dropout_p, window_size, softcap, softmax_scale)  # (dtypes, heads...)
    if v.shape != k.shape:
        _fail(f"with block_table, v must be a paged cache of k's shape {tuple(k.shape)}, got "
              f"{tuple(v.shape)} (headdim_v != headdim is not covered for paged caches)")
    if k.shape[1] < 1:
        _fail(f"the paged caches' page_size (k.shape[1]) must be >= 1, got {k.shape[1]}")
    if dropout_p:
        _fail("dropout_p must be 0 with block_table (paged caches serve inference)")
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        _fail("the paged caches k / v get no gradients through block_table; pass them detached "
              "(or under torch.no_grad()): q's gradient is supported")
    batch = _paged_batch(cu_seqlens_q)
    width = block_table.shape[1] if isinstance(block_table, Tensor) and block_table.dim() == 2 \
        else -1  # (any width)
    _check_index("block_table", block_table, (batch, width), q.device,
                 f"[batch={batch}, max_pages_per_seq]")
    # (its values: ``_check_pages``)
    if cu_seqlens_k is None:
        _fail("with block_table, pass cu_seqlens_k (int32 (batch + 1,)) or seqused_k (int32 "
              "(batch,), each sequence's key count) with cu_seqlens_k=None", TypeError)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, 0, max_seqlen_k, batch, q.device, values=False)
    capacity = decode_op.paged_capacity(block_table, k.shape[1], max_seqlen_k)
    _check_pages(cu_seqlens_k, block_table, k.shape[1], k.shape[0], max_seqlen_k, batch * capacity,
                 seqused_k)
    if backend == "reference":
        return _gather_pages_torch(k, v, cu_seqlens_k, block_table, capacity)
    # (the pages' kernel is the portable one: 'sm90' and unknown names take the copy, whose
    # backend pick runs them or says why not)
    if (backend in ("auto", "triton") and alibi_slopes is None
            and not (torch.is_grad_enabled() and q.requires_grad)
            and not decode_op.paged_varlen_copies(k, batch, capacity)):
        return None
    run = decode_op.gather_pages_op if torch.compiler.is_compiling() else decode_op.gather_pages
    return run(k, v, cu_seqlens_k, block_table, int(max_seqlen_k))


def _paged_direct(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                  max_seqlen_q: int, block_table: Tensor, softmax_scale, causal: bool,
                  window_size, softcap: float, return_attn_probs: bool,
                  learnable_sink: Optional[Tensor]):
    """(``flash_attn_varlen_func`` with block_table, after ``_paged_keys``) the attention over
    the pages, for calls too large to pack (no ALiBi, no gradient): the planned prefill kernel."""
    from ioattn.decode import op as decode_op

    # (q, k and v passed ``_check_common`` in ``_paged_keys``)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, None, q.device)
    _check_sink(learnable_sink, q.shape[1], q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    left, right = _window(causal, window_size)
    run = (decode_op.paged_varlen_attn_op if torch.compiler.is_compiling()
           else decode_op.paged_varlen_attn)
    out, lse = run(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, int(max_seqlen_q),
                   float(scale), left, right, float(softcap))
    return _finish(out, lse, return_attn_probs, learnable_sink, varlen=True)


def _check_pages(cu_seqlens_k: Tensor, block_table: Tensor, page: int, n_pages: int,
                 max_seqlen_k: int, rows: int, seqused_k: Optional[Tensor] = None) -> None:
    """cu_seqlens_k of a paged varlen call (start at 0, non-decreasing, no sequence longer than
    max_seqlen_k or its block-table row), and the table entries its keys use (the rest of a row
    may hold anything) within the caches' pages: once per state of the tensors (``Validated``),
    which then also covers the packed call's check of cu_seqlens_k over the packed rows. With
    seqused_k (cu_seqlens_k its prefix sum, new each call) the memo is keyed on seqused_k."""
    params = ("paged varlen", page, n_pages, max_seqlen_k)
    tensors = (cu_seqlens_k if seqused_k is None else seqused_k, block_table)
    if skip_value_checks(cu_seqlens_k) or VALIDATED.seen(tensors, params):
        return
    cu = cu_seqlens_k.tolist()
    lens = [b - a for a, b in zip(cu, cu[1:])]
    width = block_table.shape[1]
    for i, n in enumerate(lens):  # (first: a longer sequence would also overflow the packed rows)
        if n > width * page:
            _fail(f"sequence {i} has {n} keys but its block_table row holds {width} pages of "
                  f"{page} ({width * page} keys)")
    _check_cu_values("cu_seqlens_k", cu, rows, max_seqlen_k)
    if width and lens:  # the entries in use, checked on the device: one sync
        used = torch.tensor([-(-n // page) for n in lens], device=block_table.device)
        cols = torch.arange(width, device=block_table.device)
        bad = (cols[None, :] < used[:, None]) & ((block_table < 0) | (block_table >= n_pages))
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            _fail(f"block_table[{i}, {j}] = {int(block_table[i, j])} is outside the caches' "
                  f"{n_pages} pages")
    VALIDATED.add(tensors, params)
    if seqused_k is None:
        VALIDATED.add((cu_seqlens_k,), ("cu_seqlens_k", rows, max_seqlen_k))  # (the packed call's)


def _gather_pages_torch(k: Tensor, v: Tensor, cu_seqlens_k: Tensor, block_table: Tensor,
                        capacity: int) -> tuple[Tensor, Tensor]:
    """``decode.op.gather_pages`` in plain torch (backend='reference')."""
    b = block_table.shape[0]
    page = k.shape[1]
    k_out = k.new_zeros((b * capacity,) + tuple(k.shape[2:]))
    v_out = v.new_zeros(k_out.shape[:1] + tuple(v.shape[2:]))
    cu = cu_seqlens_k.tolist()
    for i, (a, n) in enumerate(zip(cu, [b_ - a_ for a_, b_ in zip(cu, cu[1:])])):
        if n:
            pages = block_table[i, :-(-n // page)].long()
            k_out[a:a + n] = k[pages].flatten(0, 1)[:n]
            v_out[a:a + n] = v[pages].flatten(0, 1)[:n]
    return k_out, v_out


def _unpack(packed: Tensor, name: str, axis: int, n: int) -> tuple[Tensor, ...]:
    if not isinstance(packed, Tensor):
        _fail(f"{name} must be a torch.Tensor", TypeError)
    if packed.dim() <= axis or packed.shape[axis] != n:
        _fail(f"{name} must have size {n} at dim {axis}, got shape {tuple(packed.shape)}")
    return packed.unbind(axis)


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0,
                              softmax_scale: Optional[float] = None, causal: bool = False,
                              window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                              return_attn_probs: bool = False, *,
                              learnable_sink: Optional[Tensor] = None, backend: str = "auto"):
    """``flash_attn_func`` on qkv [batch, seqlen, 3, nheads, headdim]."""
    q, k, v = _unpack(qkv, "qkv", 2, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs,
                           learnable_sink=learnable_sink, backend=backend)


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0,
                             softmax_scale: Optional[float] = None, causal: bool = False,
                             window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                             return_attn_probs: bool = False, *,
                             learnable_sink: Optional[Tensor] = None, backend: str = "auto"):
    """``flash_attn_func`` on q and kv [batch, seqlen_k, 2, nheads_k, headdim]."""
    k, v = _unpack(kv, "kv", 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs,
                           learnable_sink=learnable_sink, backend=backend)


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                                     dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                                     causal: bool = False, window_size: Sequence[int] = (-1, -1),
                                     softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                                     deterministic: bool = False, return_attn_probs: bool = False,
                                     *, learnable_sink: Optional[Tensor] = None,
                                     backend: str = "auto"):
    """``flash_attn_varlen_func`` on qkv [total, 3, nheads, headdim]."""
    q, k, v = _unpack(qkv, "qkv", 1, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs,
                                  learnable_sink=learnable_sink, backend=backend)


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                    return_attn_probs: bool = False, *,
                                    learnable_sink: Optional[Tensor] = None, backend: str = "auto"):
    """``flash_attn_varlen_func`` on q and kv [total_k, 2, nheads_k, headdim]."""
    k, v = _unpack(kv, "kv", 1, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs,
                                  learnable_sink=learnable_sink, backend=backend)

"""Dense attention forward + backward against the reference, FlashAttention's tolerance rule.

Every case checks out, LSE, dq, dk, dv with fresh random inputs; outputs are NaN-poisoned before
launch (tests/conftest.py), so an unwritten element fails.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

import ioattn
from ioattn.reference import attention_ref, attention_varlen_ref
from ioattn.testing import (GRAD_FACTOR, alibi_slopes, assert_close_rule, cu_seqlens,
                            random_seqlens)
from tests.conftest import ON_GPU

BF16, FP16 = torch.bfloat16, torch.float16


@dataclass(frozen=True)
class Case:
    s_q: int
    s_k: int
    d: int = 64
    d_v: Optional[int] = None
    b: int = 2
    h: int = 4
    h_k: Optional[int] = None
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None  # None | "h" | "bh"
    dtype: torch.dtype = BF16
    deterministic: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        parts = [f"B{self.b}-Q{self.s_q}-K{self.s_k}-H{self.h}/{self.h_k or self.h}-D{self.d}"]
        if self.d_v:
            parts.append(f"DV{self.d_v}")
        parts.append("bf16" if self.dtype == BF16 else "fp16")
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap}")
        if self.alibi:
            parts.append(f"alibi_{self.alibi}")
        if self.deterministic:
            parts.append("det")
        return "-".join(parts)


CASES = [
    Case(1, 1, d=64),
    Case(1, 1, d=32, causal=True, dtype=FP16),
    Case(113, 203, d=64),
    Case(113, 203, d=64, causal=True, dtype=FP16),
    Case(203, 113, d=64, causal=True),  # s_q > s_k: the first 90 rows see no key
    Case(128, 217, d=59, causal=True),
    Case(256, 128, d=32, window=(17, 5)),
    Case(113, 203, d=96, window=(40, -1), dtype=FP16),
    Case(113, 203, d=96, window=(-1, 7)),
    Case(128, 217, d=128, causal=True, window=(33, 0)),
    Case(113, 203, d=192, d_v=128, causal=True),
    Case(97, 97, d=256, dtype=FP16),
    Case(113, 203, d=64, softcap=1.5),
    Case(113, 203, d=64, softcap=2.0, causal=True, dtype=FP16),
    Case(113, 203, d=64, alibi="h", causal=True),
    Case(128, 217, d=64, alibi="bh", dtype=FP16),
    Case(113, 203, d=64, h=6, h_k=2, causal=True),
    Case(113, 203, d=64, h=4, h_k=1, window=(20, 20), dtype=FP16),
    Case(113, 203, d=64, h=8, h_k=2, deterministic=True, softcap=3.0, alibi="h"),
    Case(64, 64, d=16, d_v=48, b=3, h=2),
    Case(37, 300, d=8, causal=True, alibi="bh", softcap=5.0, h=4, h_k=2),
]
if ON_GPU:
    CASES += [
        Case(1023, 1024, d=64, causal=True),
        Case(1023, 1024, d=128, h=8, h_k=2, dtype=FP16),
        Case(1024, 1023, d=256, causal=True, b=1),
        Case(2048, 2048, d=128, window=(256, 0), b=1, h=8),
        Case(513, 1537, d=192, d_v=128, causal=True, softcap=10.0, b=1),
        Case(777, 777, d=96, alibi="bh", deterministic=True, h=6, h_k=3),
    ]


def _inputs(c: Case, device, scale: float = 1.0):
    h_k = c.h_k or c.h
    q = torch.randn(c.b, c.s_q, c.h, c.d, device=device, dtype=c.dtype) * scale
    k = torch.randn(c.b, c.s_k, h_k, c.d, device=device, dtype=c.dtype) * scale
    v = torch.randn(c.b, c.s_k, h_k, c.d_v or c.d, device=device, dtype=c.dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _slopes(c: Case, device):
    if c.alibi is None:
        return None
    return alibi_slopes(c.b if c.alibi == "bh" else None, c.h, device)


def _check_grads(name, outs, refs, pts, grad_out, inputs):
    got = torch.autograd.grad(outs, inputs, grad_out, retain_graph=True)
    want = torch.autograd.grad(refs, inputs, grad_out, retain_graph=True)
    base = torch.autograd.grad(pts, inputs, grad_out, retain_graph=True)
    for gname, g, r, p in zip(("dq", "dk", "dv"), got, want, base):
        assert_close_rule(f"{name} {gname}", g, r, p, factor=GRAD_FACTOR)
    return got


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_fwd_bwd(c: Case, device):
    _fwd_bwd(c, device, "auto")


@pytest.mark.skipif(not ON_GPU, reason="the GPU's long cases; CPU runs the portable kernels above")
@pytest.mark.parametrize("c", [c for c in CASES if c.s_q >= 1000 and c.window == (-1, -1)],
                         ids=lambda c: c.id)
def test_fwd_bwd_portable_long(c: Case, device):
    """The long batched cases on the portable kernels, which 'auto' now sends to the sm90 ones
    on Hopper (from 512 / 1k, ``sm90_fwd.preferred``)."""
    _fwd_bwd(c, device, "triton")


def _fwd_bwd(c: Case, device, backend: str):
    # scores large enough that softcap and the softmax shape matter
    q, k, v = _inputs(c, device, scale=1.5 if c.softcap else 1.0)
    slopes = _slopes(c, device)
    kw = dict(causal=c.causal, window_size=c.window, softcap=c.softcap, alibi_slopes=slopes)
    out, lse, none = ioattn.flash_attn_func(q, k, v, deterministic=c.deterministic,
                                            return_attn_probs=True, backend=backend, **kw)
    assert none is None and lse.dtype == torch.float32 and lse.shape == (c.b, c.h, c.s_q)
    ref, lse_ref = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_close_rule("out", out, ref, pt)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "LSE -inf pattern differs (fully masked rows)"
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=1e-3, rtol=1e-3)
    assert (out[~finite.transpose(1, 2)] == 0).all(), "fully masked rows must output 0"
    _check_grads(c.id, out, ref, pt, torch.randn_like(out), (q, k, v))


VARLEN_CASES = [
    Case(0, 0, d=64, b=5, causal=False),
    Case(0, 0, d=64, b=5, causal=True, h=6, h_k=2, dtype=FP16),
    Case(0, 0, d=96, b=4, window=(30, 3), alibi="bh"),
    Case(0, 0, d=128, b=3, softcap=2.0, causal=True, deterministic=True),
]


def _varlen_inputs(c: Case, device, same_lengths: bool = False):
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    lq = random_seqlens(c.b, 150, g)
    lk = lq if same_lengths else random_seqlens(c.b, 180, g)
    lq[0], lk[1] = 0, 0  # zero-length sequences on both sides
    h_k = c.h_k or c.h
    tq, tk = sum(lq), sum(lk)
    q = torch.randn(tq, c.h, c.d, device=device, dtype=c.dtype).requires_grad_()
    k = torch.randn(tk, h_k, c.d, device=device, dtype=c.dtype).requires_grad_()
    v = torch.randn(tk, h_k, c.d_v or c.d, device=device, dtype=c.dtype).requires_grad_()
    return q, k, v, lq, lk


@pytest.mark.parametrize("c", VARLEN_CASES, ids=lambda c: "varlen-" + c.id)
def test_varlen_fwd_bwd(c: Case, device):
    q, k, v, lq, lk = _varlen_inputs(c, device)
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)
    slopes = _slopes(c, device)
    kw = dict(causal=c.causal, window_size=c.window, softcap=c.softcap, alibi_slopes=slopes)
    out, lse, _ = ioattn.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk),
                                                deterministic=c.deterministic,
                                                return_attn_probs=True, **kw)
    assert lse.shape == (c.h, q.shape[0])
    ref, lse_ref = attention_varlen_ref(q, k, v, cq, ck, **kw)
    pt, _ = attention_varlen_ref(q, k, v, cq, ck, upcast=False, **kw)
    assert_close_rule("out", out, ref, pt)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=1e-3, rtol=1e-3)
    _check_grads(c.id, out, ref, pt, torch.randn_like(out), (q, k, v))


def test_varlen_matches_batched(device):
    """Equal lengths packed == batched call (same kernel path, different addressing). d=128: at
    d=64 the sm90 forward (forced in the IOATTN_TEST_SM90=always run) tiles batched and varlen
    calls differently (two consumer warpgroups on 128-key blocks against three on 64-key blocks),
    which changes the order of the softmax updates."""
    b, s, h, d = 3, 77, 2, 128
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=BF16) for _ in range(3))
    out = ioattn.flash_attn_func(q, k, v, causal=True)
    cu = cu_seqlens([s] * b, device)
    out_v = ioattn.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu,
                                          s, s, causal=True)
    torch.testing.assert_close(out_v.view(b, s, h, d), out, atol=0, rtol=0)


@pytest.mark.parametrize("d", [64, 128])
def test_varlen_rows_outside_sequences_are_never_read_into_outputs(d, device):
    """Rows past cu_seqlens[-1] belong to no sequence and may hold anything (torch.empty):
    NaN / Inf there must not reach any output or gradient, whatever kernel runs (tiles that
    cross a sequence end, TMA loads included)."""
    lens, h = [100, 300, 203], 4
    total = sum(lens)
    cu = cu_seqlens(lens, device)
    q, k, v = (torch.randn(total + 70, h, d, device=device, dtype=BF16) for _ in range(3))
    for t, bad in ((q, float("nan")), (k, float("inf")), (v, float("nan"))):
        t[total:] = bad
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ioattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert torch.isfinite(out[:total]).all()
    ref, _ = attention_varlen_ref(q[:total], k[:total], v[:total], cu, cu, causal=True)
    pt, _ = attention_varlen_ref(q[:total], k[:total], v[:total], cu, cu, causal=True, upcast=False)
    assert_close_rule("out", out[:total], ref, pt)
    dq, dk, dv = torch.autograd.grad(out[:total], (q, k, v), torch.randn_like(ref))
    assert all(torch.isfinite(g[:total]).all() for g in (dq, dk, dv))


def test_lse_gradient(device):
    """Gradients flow through the returned LSE as well as the output."""
    c = Case(113, 150, d=64, causal=True)
    q, k, v = _inputs(c, device)
    out, lse, _ = ioattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref, lse_ref = attention_ref(q, k, v, causal=True)
    pt, lse_pt = attention_ref(q, k, v, causal=True, upcast=False)
    w = torch.randn_like(lse)

    def loss(o, l_):
        return o.float().square().sum() + (torch.where(torch.isfinite(l_), l_, 0) * w).sum()

    got = torch.autograd.grad(loss(out, lse), (q, k, v))
    want = torch.autograd.grad(loss(ref, lse_ref), (q, k, v))
    base = torch.autograd.grad(loss(pt, lse_pt), (q, k, v))
    for name, g, r, p in zip(("dq", "dk", "dv"), got, want, base):
        assert_close_rule(name, g, r, p, factor=GRAD_FACTOR)


def test_zero_length_batched(device):
    q = torch.randn(2, 5, 2, 32, device=device, dtype=BF16, requires_grad=True)
    k = torch.randn(2, 0, 2, 32, device=device, dtype=BF16, requires_grad=True)
    v = torch.randn(2, 0, 2, 32, device=device, dtype=BF16, requires_grad=True)
    out, lse, _ = ioattn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    out.sum().backward()
    assert (q.grad == 0).all() and k.grad.shape == k.shape
    q0 = torch.randn(2, 0, 2, 32, device=device, dtype=BF16, requires_grad=True)
    k1 = torch.randn(2, 7, 2, 32, device=device, dtype=BF16, requires_grad=True)
    out = ioattn.flash_attn_func(q0, k1, k1)
    assert out.shape == (2, 0, 2, 32)
    out.sum().backward()
    assert (k1.grad == 0).all()


def test_packed_variants(device):
    b, s, h, d = 2, 65, 4, 64
    qkv = torch.randn(b, s, 3, h, d, device=device, dtype=BF16, requires_grad=True)
    q, k, v = qkv.unbind(2)
    want = ioattn.flash_attn_func(q, k, v, causal=True)
    got = ioattn.flash_attn_qkvpacked_func(qkv, causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    got.sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape
    kv = torch.stack([k, v], 2).detach()
    torch.testing.assert_close(ioattn.flash_attn_kvpacked_func(q, kv, causal=True), want, atol=0, rtol=0)
    cu = cu_seqlens([s] * b, device)
    got_v = ioattn.flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu, s, causal=True)
    torch.testing.assert_close(got_v.view(b, s, h, d), want, atol=0, rtol=0)
    got_kv = ioattn.flash_attn_varlen_kvpacked_func(q.flatten(0, 1), kv.flatten(0, 1), cu, cu, s, s,
                                                    causal=True)
    torch.testing.assert_close(got_kv.view(b, s, h, d), want, atol=0, rtol=0)


def test_noncontiguous_inputs(device):
    """Strided views (head-major storage, sliced head dim) give the same result as contiguous ones."""
    b, s, h, d = 2, 70, 3, 64
    base = torch.randn(b, h, s, d + 8, device=device, dtype=FP16)
    q = base[..., :d].transpose(1, 2)  # last-dim stride 1, odd outer strides
    k = torch.randn(b, s, h, 2 * d, device=device, dtype=FP16)[..., ::2]  # last-dim stride 2
    v = torch.randn(b, s, h, d, device=device, dtype=FP16)
    # one kernel family for both (on Hopper 'auto' may pick sm90 for the contiguous call only)
    got = ioattn.flash_attn_func(q, k, v, backend="triton")
    want = ioattn.flash_attn_func(q.contiguous(), k.contiguous(), v, backend="triton")
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    ref, _ = attention_ref(q, k, v)
    pt, _ = attention_ref(q, k, v, upcast=False)
    assert_close_rule("out (auto)", ioattn.flash_attn_func(q, k, v), ref, pt)


def test_strided_slopes_and_cu_seqlens(device):
    """Non-contiguous ALiBi slopes and cu_seqlens views index like their contiguous copies."""
    b, s, h, d = 2, 40, 3, 32
    q, k, v = (torch.randn(b * s, h, d, device=device, dtype=FP16) for _ in range(3))
    slopes = alibi_slopes(h, b, device).t()  # (b, h) view with head stride b
    cu_wide = cu_seqlens([0, s, 0, s], device)[[0, 2, 4]]  # a gathered copy to compare against
    cu_view = cu_seqlens([0, s, 0, s], device)[::2]  # strided view, same values
    got = ioattn.flash_attn_varlen_func(q, k, v, cu_view, cu_view, s, s, alibi_slopes=slopes)
    want = ioattn.flash_attn_varlen_func(q, k, v, cu_wide, cu_wide, s, s, alibi_slopes=slopes.contiguous())
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_deterministic_bitwise(device):
    c = Case(200, 333, d=64, h=4, h_k=1, causal=True)
    q, k, v = _inputs(c, device)
    g = torch.randn(c.b, c.s_q, c.h, c.d, device=device, dtype=c.dtype)
    runs = []
    for _ in range(2):
        out = ioattn.flash_attn_func(q, k, v, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), g))
    for a, b_ in zip(*runs):
        assert torch.equal(a, b_)


def test_reference_fp32_vs_fp64():
    """The reference itself: fp32 agrees with fp64 far below bf16 noise."""
    q, k, v = (torch.randn(2, 50, 2, 32, dtype=torch.float64) for _ in range(3))
    kw = dict(causal=True, softcap=3.0, alibi_slopes=torch.rand(2, dtype=torch.float32))
    o32, l32 = attention_ref(q.float(), k.float(), v.float(), **kw)
    o64, l64 = attention_ref(q, k, v, compute_dtype=torch.float64, **kw)
    assert (o32.double() - o64).abs().max() < 1e-5
    assert (l32.double() - l64).abs().max() < 1e-5


TMA_CASES = [Case(113, 203, d=64, causal=True), Case(128, 217, d=96, window=(20, 3), h=4, h_k=2),
             Case(97, 97, d=256, softcap=2.0, alibi="h", dtype=FP16)]


@pytest.mark.parametrize("c", TMA_CASES, ids=lambda c: "tma-" + c.id)
def test_fwd_tma_path(c: Case, device, monkeypatch):
    """The TMA-descriptor forward (the Hopper config) against the reference, in any environment."""
    from ioattn.dense import configs

    base = configs.fwd_config
    monkeypatch.setattr(configs, "fwd_config", lambda *a: dataclasses.replace(
        base(*a), tma=True, warp_specialize=ON_GPU, num_warps=8 if ON_GPU else base(*a).num_warps))
    q, k, v = _inputs(c, device, scale=1.5 if c.softcap else 1.0)
    kw = dict(causal=c.causal, window_size=c.window, softcap=c.softcap, alibi_slopes=_slopes(c, device))
    out = ioattn.flash_attn_func(q, k, v, backend="triton", **kw)
    ref, _ = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_close_rule("out", out, ref, pt)


BWD_VARIANTS = {"keys_as_b": dict(keys_as_b=True), "tma": dict(tma=True),
                "tma_keys_as_b": dict(tma=True, keys_as_b=True)}
BWD_VARIANT_CASES = [Case(113, 203, d=64, causal=True), Case(128, 217, d=96, window=(20, 3), h=4, h_k=2,
                                                          softcap=2.0, dtype=FP16)]


@pytest.mark.parametrize("variant", list(BWD_VARIANTS))
@pytest.mark.parametrize("c", BWD_VARIANT_CASES, ids=lambda c: c.id)
def test_bwd_variants(c: Case, variant, device, monkeypatch):
    """Backward kernel variants that configs may select (K/V as B operands, TMA loads)."""
    from ioattn.dense import configs

    base = configs.bwd_config
    monkeypatch.setattr(configs, "bwd_config",
                        lambda *a: dataclasses.replace(base(*a), **BWD_VARIANTS[variant]))
    q, k, v = _inputs(c, device, scale=1.5 if c.softcap else 1.0)
    kw = dict(causal=c.causal, window_size=c.window, softcap=c.softcap)
    out = ioattn.flash_attn_func(q, k, v, **kw)
    ref, _ = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    _check_grads(c.id, out, ref, pt, torch.randn_like(out), (q, k, v))

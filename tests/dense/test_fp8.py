"""FP8 forward (q, k, v in e4m3 with descales; O in bf16) against the reference, FlashAttention's
rule: the reference is fp32 attention over the dequantized inputs, the low-precision baseline
the same arithmetic in plain PyTorch with P rounded to e4m3 as the kernel does
(``attention_ref(..., fp8_p=True)``). Also quantization, incoherent processing and bad input."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import ioattn
from ioattn.dense import sm90_fwd
from ioattn.dense.op import dense_fwd
from ioattn.fp8 import (FP8_DTYPE, QUANT_BLOCK, dequantize, hadamard_transform, keys_contiguous,
                        quantize, quantize_qkv, random_signs)
from ioattn.reference import attention_ref, attention_varlen_ref
from ioattn.testing import alibi_slopes, assert_close_rule, cu_seqlens, rounding_atol
from tests.conftest import ON_GPU
from tests.dense.test_attention import Case as AttnCase

pytestmark = pytest.mark.skipif(
    ON_GPU and torch.cuda.get_device_capability() < (8, 9), reason="fp8 needs sm_89+")
ON_HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="the sm90 fp8 forward needs Hopper")


def _on_hopper(*values):
    """A parameter set run on Hopper only (the sm90 fp8 forward)."""
    return pytest.param(*values, marks=needs_hopper)


# 'auto', and the sm90 fp8 forward forced where there is one
BACKENDS = ["auto", _on_hopper("sm90")]


@dataclass(frozen=True)
class Case(AttnCase):
    """test_attention's case (its dtype stands for the unquantized inputs' and is not used)
    with the descales' form."""
    block: Optional[int] = QUANT_BLOCK  # descales per 128 rows, or per head (None)
    q_per_kv_head: bool = False  # q's descale [batch, nheads_k] (FlashAttention-3's form)
    no_descale: bool = False

    @property
    def id(self) -> str:
        p = [super().id.replace("-bf16", "")]
        p += ["perhead" if self.block is None else "block"]
        p += ["qkv-head"] if self.q_per_kv_head else []
        p += ["nodescale"] if self.no_descale else []
        return "-".join(p)


CASES = [
    Case(1, 1),
    Case(113, 203),
    Case(113, 203, causal=True, block=None),
    Case(203, 113, causal=True),  # s_q > s_k: the first 90 rows see no key
    Case(300, 300, d=96, window=(40, 7)),  # three descale blocks
    Case(113, 203, d=128, d_v=64, h=6, h_k=2, causal=True, q_per_kv_head=True),
    Case(113, 203, softcap=2.0, alibi="bh"),
    Case(97, 150, h=4, h_k=1, block=None, q_per_kv_head=True),
    Case(64, 64, d=32, no_descale=True),
]


def _inputs(c: Case, device, scale=(1.0, 1.0, 1.0)):
    h_k = c.h_k or c.h
    q = torch.randn(c.b, c.s_q, c.h, c.d, device=device) * scale[0]
    k = torch.randn(c.b, c.s_k, h_k, c.d, device=device) * scale[1]
    v = torch.randn(c.b, c.s_k, h_k, c.d_v or c.d, device=device) * scale[2]
    return q, k, v


def _lse_atol(lse_ref, q, k, scale=None) -> float:
    """The LSE's tolerance: fp32 rounding on CPU (the interpreter's fp8 products are summed in
    fp32); on the GPU, Hopper's fp8 MMA keeps only ~14 bits of its fp32 accumulator
    (DeepSeek-V3, sec. 3.3.2), so a score may be off by ~2^-14 of the sum of its products'
    magnitudes: the bound used is 2^-11 x scale x max sum |q_i k_i| (an LSE moves by at most its
    row's largest score error; 2^-12 was met by 1.4e-2 against 1.46e-2 at d=256 on an H100,
    and the portable and sm90 kernels gave the same LSE errors to the digit in every draw:
    results/tune/diag_fp8_lse_*). q, k: dequantized, [.., s, h, d] (varlen: [total, h, d])."""
    atol = rounding_atol(lse_ref, torch.float32)
    if ON_GPU:
        scale = scale or q.shape[-1] ** -0.5
        qa, ka = q.abs().float(), k.abs().float()
        if qa.dim() == 3:
            qa, ka = qa[None], ka[None]
        g = qa.shape[-2] // ka.shape[-2]
        ka = ka.repeat_interleave(g, dim=-2)
        sums = torch.einsum("bthd,bshd->bhts", qa, ka)
        atol = max(atol, 2 ** -11 * scale * sums.max().item())
    return atol


def _refs(q, k, v, **kw):
    ref, lse = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, fp8_p=True, **kw)
    return ref, lse, pt


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_fp8_forward(c: Case, device):
    check_fp8(c, device)


# the sm90 (Gluon) fp8 forward: batched, d = d_v in (64, 128, 256), per-head descales and
# (IOATTN_SM90_FP8_BLOCK) block descales; V keys innermost or in rows (copied keys innermost),
# lengths that are no multiple of 16 (V's rows then copied with padding), s_q > s_k, GQA with q
# descaled per KV head, softcap, windows
SM90_CASES = [
    Case(113, 203, d=128, causal=True),
    Case(300, 300, d=256, window=(40, 7)),
    Case(97, 150, h=4, h_k=1, softcap=2.0),
    Case(1024, 1024, b=2, d=128, h=4, causal=True),
    Case(1, 1, block=None),
    Case(113, 203, block=None),
    Case(113, 203, d=128, h=6, h_k=2, causal=True, block=None, q_per_kv_head=True),
    Case(203, 113, d=256, causal=True, block=None),
    Case(300, 300, d=128, window=(40, 7), block=None),
    Case(97, 150, h=4, h_k=1, block=None, softcap=2.0),
    Case(256, 512, d=128, no_descale=True),
    Case(1024, 1024, b=2, d=128, h=4, causal=True, block=None),
]


# the sm90 fp8 forward's persistent and Q-in-registers forms (on 3 CTAs, each walking many
# tiles): causal, a window, softcap with MQA, s_q > s_k, and q descaled per KV head with tiles
# 0 and 1 seeing no key
PERSISTENT_CASES = [
    Case(1024, 1024, b=2, d=128, h=4, causal=True),
    Case(300, 300, d=256, window=(40, 7)),
    Case(97, 150, h=4, h_k=1, softcap=2.0, block=None),
    Case(203, 113, d=256, causal=True, block=None),
    Case(300, 40, d=128, h=4, h_k=2, causal=True, block=None, q_per_kv_head=True),
]


def _sm90_switches(monkeypatch, **switches) -> None:
    """The sm90 fp8 forward with block descales on, and these ``sm90_fwd`` switches set."""
    for name, value in dict(FP8_ON=True, FP8_BLOCK_ON=True, **switches).items():
        monkeypatch.setattr(sm90_fwd, name, value)


@needs_hopper
@pytest.mark.parametrize("v_rows", [False, True], ids=["v-keys-innermost", "v-rows"])
@pytest.mark.parametrize("c", SM90_CASES, ids=lambda c: c.id)
def test_fp8_sm90(c: Case, v_rows, device, monkeypatch):
    _sm90_switches(monkeypatch)
    check_fp8(c, device, backend="sm90", v_rows=v_rows)


@needs_hopper
@pytest.mark.parametrize("ctas", [3, None], ids=["3-ctas", "all-sms"])
@pytest.mark.parametrize("c", PERSISTENT_CASES + [Case(1024, 1024, b=2, d=64, h=4, block=None)],
                         ids=lambda c: c.id)
def test_fp8_sm90_persistent(c: Case, ctas, device, monkeypatch):
    """The sm90 fp8 forward on persistent CTAs (IOATTN_SM90_FP8_PERSISTENT: tiles from the
    dynamic scheduler's counter, each tile's descales read by its consumers, V's keys-innermost
    rows by its producer); on 3 CTAs each walks many tiles (tiles without a key block among
    them). Twice: the counter is zeroed per launch."""
    _sm90_switches(monkeypatch, FP8_PERSISTENT=True)
    if ctas is not None:
        monkeypatch.setattr(sm90_fwd, "sm_count", lambda device: ctas)
    for _ in range(2):
        check_fp8(c, device, backend="sm90")


@needs_hopper
@pytest.mark.parametrize("persistent", [False, True], ids=["1-cta-a-tile", "persistent"])
@pytest.mark.parametrize("c", PERSISTENT_CASES + [Case(1024, 1024, b=2, d=64, h=4, causal=True)],
                         ids=lambda c: c.id)
def test_fp8_sm90_q_regs(c: Case, persistent, device, monkeypatch):
    """The sm90 fp8 forward with all of Q in registers as Q·Kᵀ's operand
    (IOATTN_SM90_FWD_Q_REGS; persistent: Q's one buffer released once loaded), on 3 CTAs,
    twice (the persistent counter is zeroed per launch). Varlen: test_fp8_varlen."""
    _sm90_switches(monkeypatch, Q_REGS_ON=True, FP8_PERSISTENT=persistent,
                   sm_count=lambda device: 3)
    assert sm90_fwd._fp8_form(c.d)["Q_REGS"] == c.d
    for _ in range(2):
        check_fp8(c, device, backend="sm90")


def check_fp8(c: Case, device, backend: str = "auto", v_rows: bool = False) -> None:
    """An fp8 forward on a fresh random case (descales as the case says) against the reference
    by FlashAttention's rule, its LSE, rows without keys, and the 'reference' backend; v_rows:
    V as [.., h, d] rows instead of quantize_qkv's keys-innermost layout."""
    # per-head descales differ by head and sequence: values scaled per (batch, head)
    q, k, v = _inputs(c, device)
    q = q * torch.rand(c.b, 1, c.h, 1, device=device).add(0.5) * 3
    v = v * torch.rand(c.b, 1, c.h_k or c.h, 1, device=device).add(0.5)
    if c.no_descale:  # values already in e4m3's range
        q8, k8, v8 = (t.to(FP8_DTYPE) for t in (q, k, v))
        qd = kd = vd = None
    else:
        q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, block_size=c.block,
                                              v_keys_contiguous=not v_rows)
        if c.q_per_kv_head:  # one q descale per KV head: requantize q with the group's max
            g = c.h // (c.h_k or c.h)
            qd = qd.view(c.b, c.h // g, g, *qd.shape[2:]).amax(2)
            rows = dequantize(torch.ones_like(q).to(FP8_DTYPE), qd)  # each row's descale
            q8 = (q / rows).clamp(-448, 448).to(FP8_DTYPE)
    slopes = alibi_slopes(c.b, c.h, device) if c.alibi else None
    kw = dict(causal=c.causal, window_size=c.window, softcap=c.softcap, alibi_slopes=slopes)
    out, lse, _ = ioattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                         return_attn_probs=True, backend=backend, **kw)
    assert out.dtype == torch.bfloat16 and out.shape == (c.b, c.s_q, c.h, c.d_v or c.d)
    ref, lse_ref, pt = _refs(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd), **kw)
    assert_close_rule("out", out, ref, pt)
    # the LSE comes from fp32 scores (P's rounding does not enter it)
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse)), "rows without keys: LSE -inf"
    assert (lse[fin] - lse_ref[fin]).abs().max().item() <= _lse_atol(
        lse_ref[fin], dequantize(q8, qd), dequantize(k8, kd)) if fin.any() else True
    assert (out[~fin.transpose(1, 2)] == 0).all()
    # the 'reference' backend computes the same in fp32
    out_r = ioattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                   backend="reference", **kw)
    assert out_r.dtype == torch.bfloat16
    assert_close_rule("reference backend", out_r, ref, pt)


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_fp8_v_layouts_agree(varlen, device):
    """V with its keys innermost (quantize_qkv's layout, read as the fp8 wgmma wants it) and V
    as [.., h, d] rows (transposed in the kernel) give the same output (bitwise on CPU). With
    160 keys the batched keys-innermost V is TMA-readable (the causal d=64 fp8 config loads
    through TMA on Hopper)."""
    q, k, v = _inputs(Case(70, 160, h=4, h_k=2), device)
    cu = None
    if varlen:
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        cu_q, cu = cu_seqlens([70, 70], device), cu_seqlens([160, 160], device)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, cu_seqlens_q=cu_q if varlen else None,
                                          cu_seqlens_k=cu)
    assert v8.stride(-3) == 1
    rows = v8.contiguous()
    outs = []
    for vv in (v8, rows):
        if varlen:
            outs.append(ioattn.flash_attn_varlen_func(q8, k8, vv, cu_q, cu, 70, 160, causal=True,
                                                      q_descale=qd, k_descale=kd, v_descale=vd))
        else:
            outs.append(ioattn.flash_attn_func(q8, k8, vv, causal=True, q_descale=qd,
                                               k_descale=kd, v_descale=vd))
    torch.testing.assert_close(outs[0], outs[1])  # (same math; bitwise on CPU)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_block_scales_far_apart(causal, backend, device, monkeypatch):
    """Blocks of K and V whose descales differ by 50x and 1/30x: the accumulator is rescaled as
    V's descale changes, so each block's P keeps its own precision. Causal: rows 0-127 see only
    the small first block, checked on their own (the large block dominates a global max).
    Also on the sm90 fp8 forward (IOATTN_SM90_FP8_BLOCK)."""
    monkeypatch.setattr(sm90_fwd, "FP8_BLOCK_ON", True)
    c = Case(300, 300, h=2)
    q, k, v = _inputs(c, device)
    k[:, 128:256] *= 50
    v[:, :128] /= 30
    v[:, 128:256] *= 50
    q8, k8, v8, qd, kd, vd = quantize_qkv(q * 0.05, k, v)
    assert vd[:, :, 1].min() > 1000 * vd[:, :, 0].max()
    out = ioattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                 causal=causal, backend=backend)
    ref, _, pt = _refs(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd), causal=causal)
    assert_close_rule("out", out, ref, pt)
    if causal:
        assert_close_rule("rows of the small block", out[:, :128], ref[:, :128], pt[:, :128])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_zero_v_descale(backend, device, monkeypatch):
    """V blocks whose descale is 0 (their values 0 whatever the e4m3 bytes; quantize never
    makes one): the first, a middle and the last block, their keys still in the softmax."""
    monkeypatch.setattr(sm90_fwd, "FP8_BLOCK_ON", True)
    c = Case(200, 520, h=2)
    q, k, v = _inputs(c, device)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    vd = vd.clone()
    vd[:, :, [0, 2, 4]] = 0
    out = ioattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                 backend=backend)
    ref, _, pt = _refs(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd))
    assert_close_rule("out", out, ref, pt)


@pytest.mark.parametrize("blocked", [True, False], ids=["block", "perhead"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_zero_k_descale(backend, blocked, device, monkeypatch):
    """K descales of 0 (K's values 0, so a uniform softmax over the visible keys) under a causal
    mask: the masked scores stay -inf, not -inf x 0 = NaN."""
    monkeypatch.setattr(sm90_fwd, "FP8_BLOCK_ON", True)
    c = Case(200, 520, h=2, causal=True)
    q, k, v = _inputs(c, device)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, block_size=QUANT_BLOCK if blocked else None)
    kd = kd.clone()
    if blocked:
        kd[:, :, [0, 3]] = 0  # the first block and the diagonal's (rows 0-199 see keys 320-519)
    else:
        kd[:, 0] = 0  # one head
    out = ioattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                 causal=True, backend=backend)
    assert not out.isnan().any()
    ref, _, pt = _refs(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd), causal=True)
    assert_close_rule("out", out, ref, pt)


def test_quantize_varlen_bounds(device):
    """Varlen quantization counts blocks up to the call's max_seqlen, and rows past the last
    sequence neither fail nor enter a descale."""
    cu = cu_seqlens([100, 30], device)
    x = torch.randn(400, 2, 64, device=device)
    x[130:] *= 1000  # padding rows past cu_seqlens[-1]
    x8, ds = quantize(x, cu_seqlens=cu, max_seqlen=400)
    assert ds.shape == (2, 2, 4)
    assert ds[:, :, 0].max() < 1  # (the padding's 1000x stayed out)
    with pytest.raises(ValueError, match="max_seqlen"):
        quantize(x, cu_seqlens=cu, max_seqlen=50)


@pytest.mark.parametrize("block", [QUANT_BLOCK, None], ids=["block", "perhead"])
@pytest.mark.parametrize("backend,d,window,v_keys,q_regs", [
    ("auto", 64, (-1, -1), False, False), ("auto", 64, (64, 0), True, False),
    _on_hopper("sm90", 64, (-1, -1), False, False), _on_hopper("sm90", 128, (-1, -1), False, False),
    _on_hopper("sm90", 256, (-1, -1), False, False), _on_hopper("sm90", 128, (64, 0), True, False),
    _on_hopper("sm90", 256, (-1, -1), False, True)],
    ids=["auto-d64", "auto-d64-window-vkeys", "sm90-d64", "sm90-d128", "sm90-d256",
         "sm90-d128-window-vkeys", "sm90-d256-q-regs"])
def test_fp8_varlen(block, backend, d, window, v_keys, q_regs, device, monkeypatch):
    """Varlen fp8, causal (empty q / k sequences, two descale blocks), also on the sm90 fp8
    forward (IOATTN_SM90_FP8_VARLEN): q, k, v longer than the last sequence with NaN rows past
    it (a key tile crossing the end must not carry them into P·V, where 0 x NaN is NaN); with a
    window (key tiles from past a sequence's first: its column offset plus the window's start)
    and V keys innermost (368 keys with the padding, TMA-readable in place: not copied)."""
    monkeypatch.setattr(sm90_fwd, "FP8_BLOCK_ON", True)
    monkeypatch.setattr(sm90_fwd, "FP8_VARLEN_ON", True)
    monkeypatch.setattr(sm90_fwd, "Q_REGS_ON", q_regs)  # (IOATTN_SM90_FWD_Q_REGS)
    lens_q, lens_k = [5, 0, 130, 17], [200, 3, 140, 0]  # empty q / k sequences, 2 blocks
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    h, h_k = 4, 2
    q = torch.randn(sum(lens_q), h, d, device=device) * 2
    k = torch.randn(sum(lens_k), h_k, d, device=device)
    v = torch.randn(sum(lens_k), h_k, d, device=device)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, block_size=block, cu_seqlens_q=cu_q,
                                          cu_seqlens_k=cu_k, v_keys_contiguous=False)
    assert qd.shape[:2] == (4, h) and (block is None or qd.shape[2] == 2)

    def nan_tail(t, n):  # n more rows of e4m3 NaN
        nan = torch.full((n,) + t.shape[1:], float("nan"), device=device)
        return torch.cat([t, nan.to(t.dtype)])

    v_in = nan_tail(v8, 25)  # 343 + 25 = 368 keys, a multiple of 16
    if v_keys:
        v_in = keys_contiguous(v_in)
        assert v_in.stride(0) == 1
    kw = dict(causal=True, window_size=window)
    out, lse, _ = ioattn.flash_attn_varlen_func(
        nan_tail(q8, 9), nan_tail(k8, 25), v_in, cu_q, cu_k, max(lens_q), max(lens_k),
        q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True, backend=backend,
        **kw)
    out, lse = out[:sum(lens_q)], lse[:, :sum(lens_q)]
    dq, dk, dv = (dequantize(t, ds, cu_seqlens=cu) for t, ds, cu in
                  ((q8, qd, cu_q), (k8, kd, cu_k), (v8, vd, cu_k)))
    ref, lse_ref = attention_varlen_ref(dq, dk, dv, cu_q, cu_k, **kw)
    pt, _ = attention_varlen_ref(dq, dk, dv, cu_q, cu_k, fp8_p=True, **kw)
    assert_close_rule("out", out, ref, pt)
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - lse_ref[fin]).abs().max().item() <= _lse_atol(lse_ref[fin], dq, dk)


def test_fp8_sink(device):
    """learnable_sink composes with the fp8 forward as with bf16 (folded in from out and LSE)."""
    q, k, v = _inputs(Case(33, 47), device)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    sink = torch.randn(4, device=device)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, learnable_sink=sink, causal=True,
              return_attn_probs=True)
    out, lse, _ = ioattn.flash_attn_func(q8, k8, v8, **kw)
    ref, lse_ref = attention_ref(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd),
                                 causal=True, learnable_sink=sink)
    _, _, pt = _refs(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd), causal=True)
    pt = pt.float() * torch.exp(attention_ref(dequantize(q8, qd), dequantize(k8, kd),
                                              dequantize(v8, vd), causal=True)[1]
                                - lse_ref).transpose(1, 2)[..., None]
    assert_close_rule("out", out, ref, pt)
    assert (lse - lse_ref).abs().max().item() <= _lse_atol(lse_ref, dequantize(q8, qd),
                                                            dequantize(k8, kd))


def test_quantize_roundtrip(device):
    x = torch.randn(2, 300, 3, 64, device=device)
    x[1, 130:256] *= 40  # one block with large values: its own descale
    x[0, :, 1] = 0  # a zero head: descale 1
    x8, ds = quantize(x)
    assert x8.dtype == FP8_DTYPE and ds.shape == (2, 3, 3) and ds.dtype == torch.float32
    assert (ds[0, 1] == 1).all()
    assert ds[1, :, 1].min() > 10 * ds[1, :, 0].max()
    back = dequantize(x8, ds)
    # e4m3: 3 mantissa bits, relative rounding error <= 2^-4 (normal range)
    big = x.abs() > ds.amax() * 2 ** -6 * 1.01
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + 1e-6)[big].all()
    x8h, dsh = quantize(x, block_size=None)
    assert dsh.shape == (2, 3)
    assert torch.allclose(dsh, ds.amax(2))
    with pytest.raises(ValueError, match="block_size"):
        quantize(x, block_size=64)
    with pytest.raises(TypeError, match="bf16"):
        quantize(x8)


def test_hadamard_keeps_scores(device):
    d = 96  # not a power of two: 3 blocks of 32
    q, k = torch.randn(2, 7, 3, d, device=device), torch.randn(2, 9, 3, d, device=device)
    signs = random_signs(d, seed=3, device=device)
    qh, kh = hadamard_transform(q, signs), hadamard_transform(k, signs)
    s = torch.einsum("bthd,bshd->bhts", q, k)
    sh = torch.einsum("bthd,bshd->bhts", qh, kh)
    assert (s - sh).abs().max() < 1e-4 * s.abs().max()
    assert not torch.allclose(q, qh)


def test_hadamard_with_outliers(device):
    """Incoherent processing: with an outlier channel in q and k (as LLM activations have), the
    Hadamard-rotated fp8 inputs give attention closer to the unquantized one (FlashAttention-3
    sec. 4.3 measures 2.9x lower RMSE). The quantization's share of the error is measured on
    the dequantized inputs (the 'reference' backend: the kernel's P rounding, the same either
    way, would blur it; 30 draws on CPU gave ratios 0.16-0.59); the kernel's output on the
    rotated inputs is checked by the rule."""
    b, s, h, d = 2, 256, 4, 64
    q, k, v = (torch.randn(b, s, h, d, device=device) for _ in range(3))
    q[..., 3] *= 30
    k[..., 3] *= 30
    q, k = q * 0.3, k * 0.3
    ref, _ = attention_ref(q, k, v)
    errs = []
    for had in (False, True):
        q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, hadamard=had)
        out = ioattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                     backend="reference")
        errs.append((out.float() - ref).pow(2).mean().sqrt().item())
    assert errs[1] < 0.75 * errs[0], errs
    out = ioattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    ref8, _, pt = _refs(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd))
    assert_close_rule("out (Hadamard inputs)", out, ref8, pt)


def test_fp8_bad_input(device, monkeypatch):
    monkeypatch.setattr(sm90_fwd, "FP8_ON", False)  # (the refusal of backend='sm90' below)
    q, k, v = _inputs(Case(16, 16), device)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        ioattn.flash_attn_func(q8, k.bfloat16(), v8)
    with pytest.raises(ValueError, match="fp8 inputs"):
        ioattn.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), q_descale=qd)
    with pytest.raises(ValueError, match=r"q_descale has shape"):
        ioattn.flash_attn_func(q8, k8, v8, q_descale=qd[:1])
    with pytest.raises(ValueError, match=r"k_descale has shape"):
        ioattn.flash_attn_func(q8, k8, v8, k_descale=torch.ones(2, 3, 1, device=device))
    with pytest.raises(TypeError, match="float32"):
        ioattn.flash_attn_func(q8, k8, v8, v_descale=vd.half())
    with pytest.raises(ValueError, match="no dropout"):
        ioattn.flash_attn_func(q8, k8, v8, dropout_p=0.1)
    with pytest.raises(ValueError, match="forward only"):
        ioattn.flash_attn_func(q8.requires_grad_(), k8, v8)
    q8.requires_grad_(False)
    with pytest.raises(ValueError, match="sm90"):
        ioattn.flash_attn_func(q8, k8, v8, backend="sm90")
    cu = cu_seqlens([16, 16], device)
    with pytest.raises(ValueError, match="block_table"):
        ioattn.flash_attn_varlen_func(q8.flatten(0, 1), k8, v8, cu, cu, 16, 16,
                                      block_table=torch.zeros(2, 1, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="IOATTN_SM90_FP8=0"):  # (the switch off, above)
        dense_fwd(q8, k8, v8, None, None, 16, 16, 0.1, -1, -1, 0.0, None, 0.0, None, "sm90")


def test_opcheck_fp8(device):
    q, k, v = _inputs(Case(19, 23, d=32, h=4, h_k=2), device)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    torch.library.opcheck(dense_fwd, (q8, k8, v8, None, None, 19, 23, 0.2, -1, 0, 0.0, None, 0.0,
                                      None, "triton", "triton", False, qd, kd, vd),
                          test_utils=("test_faketensor",))  # (test_schema multiplies the
    # fp8 inputs, which torch's CPU kernels do not)


def test_compile_fp8(device):
    """torch.compile(fullgraph=True) traces the fp8 call into the op (aot_eager under the
    interpreter, inductor on the GPU)."""
    q, k, v = _inputs(Case(19, 23, d=32, h=4, h_k=2), device)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)

    def f(q8, k8, v8, qd, kd, vd):
        return ioattn.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                                      v_descale=vd)

    out = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")(
        q8, k8, v8, qd, kd, vd)
    torch.testing.assert_close(out, f(q8, k8, v8, qd, kd, vd))

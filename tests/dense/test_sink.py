"""Attention sinks (``learnable_sink``, gpt-oss): one extra logit per head in every row's softmax,
with no value. Outputs, LSE and every gradient (q, k, v and the sink) against the reference that
softmaxes an explicit sink column; batched and varlen, GQA, masks, rows that see no key."""
from __future__ import annotations

import pytest
import torch

import ioattn
from ioattn.reference import attention_ref, attention_varlen_ref
from ioattn.testing import GRAD_FACTOR, assert_close_rule, cu_seqlens, rounding_atol
from tests.dense.test_attention import FP16, Case, _check_grads, _inputs, _varlen_inputs

CASES = [
    Case(113, 203, d=64),
    Case(203, 113, d=96, causal=True, dtype=FP16),  # the first 90 rows see no key
    Case(128, 128, d=64, h=6, h_k=2, window=(17, 5)),
    Case(64, 300, d=128, causal=True, b=1, h=2),
]


def _sink(h, device):
    # around the scores' scale, so the sink takes a real share of each row
    return (torch.randn(h, device=device) * 2).requires_grad_()


def _dsink_rounding(pt_parts, sink, dout, varlen):
    """Per head, the spread of dsink that rounding the attention output to its dtype causes:
    dsink sums dout * out * d(r)/d(sink) over every element of a head (r = sigmoid(lse - sink),
    the keys' share of each row), and the elements' roundings add up like a random walk: their
    standard deviation is about 0.2 eps sqrt(sum of squares) (a rounding is uniform within an ulp,
    eps |x| / 2 to eps |x| wide). eps sqrt(sum of squares), about five of those, the largest head's."""
    out, lse = pt_parts
    s = sink.detach().float().view(-1, 1) if varlen else sink.detach().float().view(1, -1, 1)
    r = torch.sigmoid(lse.float() - s)  # 0 for rows without keys (lse = -inf)
    w = r * (1 - r)
    w = w.t() if varlen else w.transpose(1, 2)  # out's layout: [.., seqlen, nheads]
    terms = dout.float() * out.float() * w[..., None]
    per_head = terms.transpose(-2, -1).reshape(-1, terms.shape[-2]).pow(2).sum(0).sqrt()
    return torch.finfo(out.dtype).eps * per_head.max().item()


def _check_sink_grad(name, outs, refs, pt_parts, dout, sink, varlen=False):
    """The FlashAttention rule for the sink's gradient. Its baseline is the same computation in
    PyTorch's low precision: attention without the sink (output in q's dtype, fp32 LSE), then the
    sink folded in as ``api._with_sink`` does. Like FlashAttention's backward (delta = rowsum(dO
    * O)) that reads the rounded output, and the gradient sums it over every row of a head: the
    rounding term is the sum's (``_dsink_rounding``; dsink is fp32). The baseline's own error is
    such a sum too, so by chance it can be far below the kernel's (one GPU run: 1.3e-3 against
    5.1e-3, fp16 d=96 causal); the rounding term covers that."""
    from ioattn.dense.api import _with_sink

    base_out, _ = _with_sink(*pt_parts, sink, varlen)
    (got,), (want,), (base,) = (torch.autograd.grad(o, (sink,), dout, retain_graph=True)
                                for o in (outs, refs, base_out))
    err = (got - want).abs().max().item()
    base_err = (base - want).abs().max().item()
    atol = max(rounding_atol(want, outs.dtype), _dsink_rounding(pt_parts, sink, dout, varlen))
    assert err <= GRAD_FACTOR * base_err + atol, (
        f"{name} dsink: max err {err:.3e} > {GRAD_FACTOR} x PyTorch low-precision err "
        f"{base_err:.3e} + atol {atol:.1e}")


@pytest.mark.parametrize("c", CASES, ids=lambda c: "sink-" + c.id)
def test_sink_fwd_bwd(c: Case, device):
    q, k, v = _inputs(c, device)
    sink = _sink(c.h, device)
    kw = dict(causal=c.causal, window_size=c.window, learnable_sink=sink)
    out, lse, _ = ioattn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    ref, lse_ref = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_close_rule("out", out, ref, pt)
    # the LSE includes the sink: finite on every row, rows without keys give exactly the sink
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)
    dout = torch.randn_like(out)
    _check_grads(c.id, out, ref, pt, dout, (q, k, v))
    no_sink = dict(causal=c.causal, window_size=c.window)
    _check_sink_grad(c.id, out, ref, attention_ref(q, k, v, upcast=False, **no_sink), dout, sink)


def test_sink_varlen(device):
    c = Case(0, 0, d=64, b=4, h=4, h_k=2, causal=True)
    q, k, v, lq, lk = _varlen_inputs(c, device)
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)
    sink = _sink(c.h, device)
    kw = dict(causal=True, learnable_sink=sink)
    out, lse, _ = ioattn.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk),
                                                return_attn_probs=True, **kw)
    ref, lse_ref = attention_varlen_ref(q, k, v, cq, ck, **kw)
    pt, _ = attention_varlen_ref(q, k, v, cq, ck, upcast=False, **kw)
    assert_close_rule("varlen out", out, ref, pt)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)
    dout = torch.randn_like(out)
    _check_grads("varlen", out, ref, pt, dout, (q, k, v))
    pt_parts = attention_varlen_ref(q, k, v, cq, ck, upcast=False, causal=True)
    _check_sink_grad("varlen", out, ref, pt_parts, dout, sink, varlen=True)


def test_sink_of_minus_infinity_is_no_sink(device):
    c = Case(77, 77, d=64, causal=True)
    q, k, v = (t.detach() for t in _inputs(c, device))
    none = ioattn.flash_attn_func(q, k, v, causal=True)
    off = ioattn.flash_attn_func(q, k, v, causal=True,
                                 learnable_sink=torch.full((c.h,), float("-inf"), device=device))
    assert torch.equal(off, none)


@pytest.mark.parametrize("sink, match", [
    (lambda d: torch.zeros(3, device=d), r"\[nheads=4\]"),
    (lambda d: torch.zeros(4, dtype=torch.int32, device=d), "float"),
    (lambda d: [0.0] * 4, "must be a tensor"),
])
def test_sink_errors(sink, match, device):
    q = torch.randn(1, 16, 4, 64, device=device, dtype=torch.float16)
    with pytest.raises((ValueError, TypeError), match=match):
        ioattn.flash_attn_func(q, q, q, learnable_sink=sink(device))


def test_sink_compiles_fullgraph(device):
    """The sink folds in with plain tensor ops around the attention op: torch.compile traces it
    without graph breaks, and the sink (a parameter) gets the eager gradient."""
    from tests.dense.test_op import BACKEND

    torch._dynamo.reset()
    q, k, v = (t.detach() for t in _inputs(Case(33, 33, d=64, h=2), device))
    sink = torch.nn.Parameter(torch.randn(2, device=device))

    def f(q, k, v, sink):
        return ioattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)

    # elementwise checks: a sum over the bf16 output cancels to ~0.3 while its rounding noise is
    # ~0.05, so comparing sums compared noise (inductor rounds the fused sink scaling once)
    out = torch.compile(f, fullgraph=True, backend=BACKEND)(q, k, v, sink)
    out_eager = f(q, k, v, sink)
    torch.testing.assert_close(out, out_eager, atol=2e-2, rtol=2e-2)
    grad_out = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, (sink,), grad_out)
    (g_eager,) = torch.autograd.grad(out_eager, (sink,), grad_out)
    torch.testing.assert_close(g, g_eager, atol=5e-2 * g_eager.abs().max().item(), rtol=5e-2)


@pytest.mark.parametrize("s_q, causal", [(1, False), (5, True)], ids=["decode", "verify-causal"])
def test_sink_with_kvcache(s_q, causal, device):
    """Attention sinks at decode time (``flash_attn_with_kvcache``, gpt-oss serving): each
    sequence against the reference over its cache prefix, with the sink."""
    b, h, h_k, d, cap = 3, 4, 2, 64, 96
    q = torch.randn(b, s_q, h, d, device=device, dtype=FP16)
    k_cache = torch.randn(b, cap, h_k, d, device=device, dtype=FP16)
    v_cache = torch.randn(b, cap, h_k, d, device=device, dtype=FP16)
    lens = torch.tensor([96, 40, 7], dtype=torch.int32, device=device)
    sink = torch.randn(h, device=device) * 2
    out, lse = ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                              causal=causal, return_softmax_lse=True,
                                              learnable_sink=sink)
    for i, n in enumerate(lens.tolist()):
        kw = dict(causal=causal, learnable_sink=sink)
        ref, lse_ref = attention_ref(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n], **kw)
        pt, _ = attention_ref(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n],
                              upcast=False, **kw)
        assert_close_rule(f"out[{i}]", out[i:i + 1], ref, pt)
        torch.testing.assert_close(lse[i:i + 1], lse_ref, atol=1e-3, rtol=1e-3)

"""ioattn.scaled_dot_product_attention: torch's SDPA call on the fused kernels, checked against
torch's semantics (top-left causal, masks, GQA, leading dims) with FlashAttention's tolerance
rule on the output and every gradient; masks and fp32 through plain PyTorch; errors by name."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ioattn
from ioattn.reference import attention_ref
from ioattn.testing import assert_close_rule
from tests.conftest import ON_GPU
from tests.dense.test_attention import _check_grads

BF16, FP16 = torch.bfloat16, torch.float16
BACKEND = "inductor" if ON_GPU else "aot_eager"


def _qkv(b, h, h_k, s_q, s_k, d, d_v, dtype, device):
    q = torch.randn(b, h, s_q, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, h_k, s_k, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, h_k, s_k, d_v, device=device, dtype=dtype, requires_grad=True)
    return q, k, v


def _ref(q, k, v, causal, scale, upcast):
    """torch's SDPA semantics through the repo's reference ([b, s, h, d]; top-left causal as
    an explicit mask), in fp32 (upcast) or in the inputs' precision (the rule's baseline)."""
    s_q, s_k = q.shape[-2], k.shape[-2]
    mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril() if causal else None
    out, _ = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), softmax_scale=scale,
                           attn_mask=mask, upcast=upcast)
    return out.transpose(1, 2)


# (b, h, h_k, s_q, s_k, d, d_v, causal, dtype, scale)
CASES = [
    (2, 4, 4, 113, 203, 64, 64, False, BF16, None),
    (2, 4, 4, 113, 203, 64, 64, True, FP16, None),   # L < S: query i sees keys 0..i
    (2, 4, 4, 203, 113, 64, 64, True, BF16, 0.3),    # L > S: rows past S see every key
    (1, 6, 2, 97, 97, 96, 96, True, BF16, None),     # GQA (enable_gqa)
    (2, 4, 1, 64, 80, 32, 48, False, FP16, None),    # one K/V head, broadcast; d_v != d
    (1, 2, 2, 1, 1, 128, 128, True, BF16, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:8]))
                         + ("-bf16" if c[8] == BF16 else "-fp16"))
def test_sdpa_matches_torch_semantics(case, device):
    b, h, h_k, s_q, s_k, d, d_v, causal, dtype, scale = case
    q, k, v = _qkv(b, h, h_k, s_q, s_k, d, d_v, dtype, device)
    out = ioattn.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=h != h_k)
    assert out.shape == (b, h, s_q, d_v) and out.dtype == dtype
    ref = _ref(q, k, v, causal, scale, upcast=True)
    pt = _ref(q, k, v, causal, scale, upcast=False)
    assert_close_rule("out", out, ref, pt)
    if q.device.type == "cpu":  # torch's own SDPA (fp32) agrees with the reference
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                              scale=scale, enable_gqa=h != h_k)
        # (ref is rounded to the inputs' dtype)
        torch.testing.assert_close(ref.float(), want, atol=1e-2, rtol=1e-2)
    _check_grads("sdpa", out, ref, pt, torch.randn_like(out), (q, k, v))


SM90_CASES = [
    (2, 4, 4, 300, 300, 128, 128, True, BF16, None),  # folded: [b * h, s, 1, d] read in place
    (1, 8, 8, 203, 333, 64, 64, True, FP16, None),    # L < S, folded
    (2, 8, 2, 257, 190, 128, 128, True, BF16, None),  # GQA, L > S: [b, s, h, d] copies
    (2, 8, 1, 200, 230, 96, 96, True, BF16, None),    # MQA at d=96: one K/V head, in place
]


@pytest.mark.skipif(not ON_GPU, reason="the sm90 kernels need an H100/H200")
@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: "-".join(map(str, c[:8])))
def test_sdpa_on_sm90(case):
    """backend='sm90' through both layouts (folded heads read in place; GQA's copies)."""
    from ioattn.dispatch import sm90_unavailable_reason

    if sm90_unavailable_reason(torch.device("cuda")) is not None:
        pytest.skip("needs sm90 with Triton 3.6.x")
    b, h, h_k, s_q, s_k, d, d_v, causal, dtype, scale = case
    q, k, v = _qkv(b, h, h_k, s_q, s_k, d, d_v, dtype, "cuda")
    out = ioattn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=h != h_k,
                                              backend="sm90")
    ref = _ref(q, k, v, causal, scale, upcast=True)
    pt = _ref(q, k, v, causal, scale, upcast=False)
    assert_close_rule("out", out, ref, pt)
    _check_grads("sdpa sm90", out, ref, pt, torch.randn_like(out), (q, k, v))


def test_sdpa_reads_views_of_the_callers_tensors(device, monkeypatch):
    """As many K/V heads as query heads: the kernels get [b * h, s, 1, d] views of the caller's
    memory (no copies, one head packed in each row, as TMA reads it) and the output comes back
    in SDPA's contiguous [b, h, L, d_v] layout."""
    from ioattn.dense import sdpa

    seen = []
    orig = sdpa.flash_attn_func
    monkeypatch.setattr(sdpa, "flash_attn_func",
                        lambda q, k, v, **kw: seen.append((q, k, v)) or orig(q, k, v, **kw))
    q, k, v = (t.detach() for t in _qkv(2, 4, 4, 33, 47, 32, 48, FP16, device))
    out = ioattn.scaled_dot_product_attention(q, k, v)
    (qq, kk, vv), = seen
    assert qq.shape == (8, 33, 1, 32) and kk.shape == (8, 47, 1, 32) and vv.shape == (8, 47, 1, 48)
    assert [t.data_ptr() for t in (qq, kk, vv)] == [t.data_ptr() for t in (q, k, v)]
    assert qq.is_contiguous() and out.shape == (2, 4, 33, 48) and out.is_contiguous()
    # a [b, s, h, d] projection's transpose: read as it was made, [b, s, h, d], heads packed
    seen.clear()
    x = torch.randn(2, 33, 4, 32, device=device, dtype=FP16)
    out = ioattn.scaled_dot_product_attention(x.transpose(1, 2), k, v)
    (qq, _, _), = seen
    assert qq.shape == (2, 33, 4, 32) and qq.is_contiguous() and qq.data_ptr() == x.data_ptr()
    assert out.shape == (2, 4, 33, 48)


def test_sdpa_leading_dims(device):
    """[heads, L, d] and [b1, b2, heads, L, d] fold into one batch and come back shaped."""
    x = torch.randn(2, 3, 4, 37, 32, device=device, dtype=FP16)
    y = torch.randn(2, 3, 4, 41, 32, device=device, dtype=FP16)
    out5 = ioattn.scaled_dot_product_attention(x, y, y, is_causal=True)
    out4 = ioattn.scaled_dot_product_attention(x.flatten(0, 1), y.flatten(0, 1), y.flatten(0, 1),
                                               is_causal=True)
    assert out5.shape == x.shape
    torch.testing.assert_close(out5.flatten(0, 1), out4, atol=0, rtol=0)
    out3 = ioattn.scaled_dot_product_attention(x[1, 2], y[1, 2], y[1, 2], is_causal=True)
    torch.testing.assert_close(out3, out5[1, 2], atol=0, rtol=0)


def test_sdpa_empty_sequences(device):
    """No keys: zeros (torch's safe softmax); no queries: an empty output."""
    q, k, v = _qkv(1, 2, 2, 5, 0, 32, 32, BF16, device)
    out = ioattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == (1, 2, 5, 32) and torch.equal(out, torch.zeros_like(out))
    q, k, v = _qkv(1, 2, 2, 0, 7, 32, 32, BF16, device)
    assert ioattn.scaled_dot_product_attention(q, k, v, is_causal=True).shape == (1, 2, 0, 32)


@pytest.mark.parametrize("kind", ["bool", "bool-batched", "float"])
def test_sdpa_masks_in_pytorch(kind, device):
    """attn_mask has no fused kernel: 'auto' computes it in plain PyTorch (fp32 math) and
    matches torch's SDPA, a fully masked row included; 'triton' and 'sm90' refuse it."""
    q, k, v = _qkv(2, 4, 4, 33, 47, 32, 32, BF16, device)
    if kind == "bool":
        mask = torch.rand(33, 47, device=device) > 0.3
        mask[5] = False  # a row with no visible key: zeros
    elif kind == "bool-batched":
        mask = torch.rand(2, 1, 33, 47, device=device) > 0.5
    else:
        mask = torch.randn(2, 4, 33, 47, device=device, dtype=BF16)
    out = ioattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                          attn_mask=mask if kind != "float" else mask.float())
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    if kind == "bool":
        assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(want, (q, k, v), dout.float())
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.float(), r.float(), atol=2e-2, rtol=2e-2)
    for backend in ("triton", "sm90"):
        with pytest.raises(ValueError, match="attn_mask"):
            ioattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)


def test_sdpa_float_mask_dead_rows(device):
    """A row whose float bias is -inf everywhere: zeros and finite (zero) gradients, as torch's
    safe softmax."""
    q, k, v = _qkv(1, 2, 2, 9, 13, 16, 16, torch.float32, device)
    mask = torch.randn(9, 13, device=device)
    mask[3] = float("-inf")
    out = ioattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(want, (q, k, v), dout)
    for g, r in zip(got, ref):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_sdpa_auto_takes_pytorch_where_kernels_cannot(device, monkeypatch):
    """What torch accepts and the kernels do not runs in plain PyTorch under 'auto': a scale
    <= 0, and tensors on a device without a Triton backend (CPU without the interpreter)."""
    from ioattn.dense import sdpa

    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 20, 24, 16, 16, FP16, device))
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=-0.5)
    got = ioattn.scaled_dot_product_attention(q, k, v, scale=-0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)
    monkeypatch.setattr(sdpa, "triton_unavailable_reason", lambda device: "no Triton here")
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    got = ioattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


def test_sdpa_fp32_and_reference(device):
    """fp32 has no fused kernel: 'auto' and 'reference' run plain PyTorch; 'triton' refuses."""
    q, k, v = _qkv(1, 2, 2, 20, 30, 16, 16, torch.float32, device)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for backend in ("auto", "reference"):
        got = ioattn.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="fp16 / bf16"):
        ioattn.scaled_dot_product_attention(q, k, v, backend="triton")


def test_sdpa_dropout(device):
    """dropout_p > 0 drops weights (the kernels' Philox stream, seeded by torch's generator):
    the same seed gives the same output, another seed another one."""
    q, k, v = _qkv(1, 2, 2, 40, 40, 32, 32, FP16, device)

    def run(seed):
        torch.manual_seed(seed)
        return ioattn.scaled_dot_product_attention(q, k, v, dropout_p=0.3)

    a, b, c = run(1), run(1), run(2)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, ioattn.scaled_dot_product_attention(q, k, v))


def test_sdpa_compiles_fullgraph(device):
    """torch.compile(fullgraph=True) traces the call (layout views, the kernels' torch.library
    op) without a graph break."""
    q, k, v = (t.detach() for t in _qkv(2, 4, 2, 19, 23, 32, 32, BF16, device))

    def f(q, k, v):
        return ioattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend=BACKEND)(q, k, v)
    torch.testing.assert_close(got, f(q, k, v), atol=0, rtol=0)


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: dict(attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True),
     "is_causal"),
    (lambda q, k, v: dict(key=k[:, :3], value=v[:, :3]), "enable_gqa=True"),
    (lambda q, k, v: dict(key=k[:, :3], value=v[:, :3], enable_gqa=True), "multiple"),
    (lambda q, k, v: dict(key=k[..., :16]), "head_dim"),
    (lambda q, k, v: dict(value=v[:, :, :5]), "same heads and seqlen"),
    (lambda q, k, v: dict(dropout_p=1.0), "dropout_p"),
    (lambda q, k, v: dict(backend="cudnn"), "backend"),
    (lambda q, k, v: dict(query=q[0, 0]), "at least 3"),
    (lambda q, k, v: dict(key=k[:1], value=v[:1]), "leading"),
    (lambda q, k, v: dict(attn_mask=torch.ones(8, 9, dtype=torch.bool)), "broadcast"),
    (lambda q, k, v: dict(scale=math.inf), "scale"),
])
def test_sdpa_errors(call, match):
    q, k, v = (torch.randn(2, 4, 8, 32, dtype=BF16) for _ in range(3))
    kw = dict(query=q, key=k, value=v)
    kw.update(call(q, k, v))
    with pytest.raises(ValueError, match=match):
        ioattn.scaled_dot_product_attention(**kw)


def test_sdpa_type_errors():
    q = torch.randn(1, 2, 8, 32, dtype=BF16)
    with pytest.raises(TypeError, match="dtypes differ"):
        ioattn.scaled_dot_product_attention(q, q.half(), q)
    with pytest.raises(TypeError, match="attn_mask's dtype"):
        ioattn.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        ioattn.scaled_dot_product_attention(q, q.tolist(), q)

"""Dropout: in-kernel Philox, reproducible from torch's generator, regenerated in the backward."""
import pytest
import torch

import ioattn
from ioattn.dense.op import draw_rng_state
from ioattn.dense.params import make_params
from ioattn.dense.triton_fwd import dropout_keep_mask
from ioattn.reference import attention_ref, attention_varlen_ref
from ioattn.testing import GRAD_FACTOR, assert_close_rule, cu_seqlens

P = 0.17


def _keep_mask(seed, q, k, v, cq=None, ck=None, mq=0, mk=0):
    torch.manual_seed(seed)
    rng = draw_rng_state(q.device)
    p = make_params(q, k, v, cq, ck, mq, mk, 1.0, -1, -1, 0.0, None, P, rng)
    return dropout_keep_mask(p, q.shape[-2], q.device)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_exact(causal, device):
    b, s_q, s_k, h, d = 2, 113, 150, 4, 64
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, requires_grad=True)
               for s in (s_q, s_k, s_k))
    seed = 1234
    torch.manual_seed(seed)
    out = ioattn.flash_attn_func(q, k, v, dropout_p=P, causal=causal)
    mask = _keep_mask(seed, q, k, v)
    kw = dict(causal=causal, dropout_p=P, dropout_mask=mask)
    ref, _ = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_close_rule("out", out, ref, pt)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    base = torch.autograd.grad(pt, (q, k, v), g)
    for name, a, r, p_ in zip(("dq", "dk", "dv"), got, want, base):
        assert_close_rule(name, a, r, p_, factor=GRAD_FACTOR)


def test_dropout_varlen_exact(device):
    lq, lk = [40, 0, 77], [60, 33, 0]
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)
    h, d = 2, 32
    q = torch.randn(sum(lq), h, d, device=device, dtype=torch.float16, requires_grad=True)
    k = torch.randn(sum(lk), h, d, device=device, dtype=torch.float16, requires_grad=True)
    v = torch.randn(sum(lk), h, d, device=device, dtype=torch.float16, requires_grad=True)
    torch.manual_seed(7)
    out = ioattn.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), dropout_p=P)
    mask = _keep_mask(7, q, k, v, cq, ck, max(lq), max(lk))
    masks = [mask[i, :, :lq[i], :lk[i]] for i in range(3)]
    ref, _ = attention_varlen_ref(q, k, v, cq, ck, dropout_p=P, dropout_mask=masks)
    pt, _ = attention_varlen_ref(q, k, v, cq, ck, dropout_p=P, dropout_mask=masks, upcast=False)
    assert_close_rule("out", out, ref, pt)
    g = torch.randn_like(out)
    for name, a, r, p_ in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), g),
                              torch.autograd.grad(ref, (q, k, v), g),
                              torch.autograd.grad(pt, (q, k, v), g)):
        assert_close_rule(name, a, r, p_, factor=GRAD_FACTOR)


def test_dropout_statistics(device):
    q, k, v = (torch.randn(2, 128, 4, 32, device=device, dtype=torch.bfloat16) for _ in range(3))
    mask = _keep_mask(99, q, k, v)
    n = mask.numel()
    frac = mask.float().mean().item()
    # binomial: 6 sigma
    assert abs(frac - (1 - P)) < 6 * (P * (1 - P) / n) ** 0.5
    # independent across heads and rows (not one pattern repeated)
    assert not torch.equal(mask[0, 0], mask[0, 1]) and not torch.equal(mask[0, 0], mask[1, 0])
    assert not torch.equal(mask[0, 0, 0], mask[0, 0, 1])


def test_dropout_reproducible(device):
    q, k, v = (torch.randn(1, 64, 2, 32, device=device, dtype=torch.bfloat16) for _ in range(3))
    torch.manual_seed(5)
    a = ioattn.flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    b = ioattn.flash_attn_func(q, k, v, dropout_p=0.5)
    c = ioattn.flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)

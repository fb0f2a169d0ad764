"""The sm90 paged forward of flash_attn_with_kvcache (Hopper only): long query chunks over a paged
cache, its producer loading K/V page by page with TMA (``ioattn.dense.sm90_fwd.
attn_fwd_sm90_paged``, picked by ``ioattn.decode.op.sm90_paged``)."""
from __future__ import annotations

import pytest
import torch

import ioattn
from ioattn.decode import op
from ioattn.dense import sm90_fwd
from ioattn.dispatch import sm90_unavailable_reason
from ioattn.reference import kvcache_attention_ref
from ioattn.testing import assert_close_rule
from tests.decode.test_kvcache import FP16, KVCase, _build, check_against_ref

needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or sm90_unavailable_reason(torch.device("cuda")) is not None,
    reason="the sm90 paged forward needs a Hopper GPU")

CASES = [
    # chunked prefill: new tokens appended, then attended causally over the pages
    KVCase(b=3, s_q=256, h=32, h_k=8, d=128, page=16, capacity=2048, causal=True, s_new=256,
           empty_seq=True),
    KVCase(b=2, s_q=200, h=16, h_k=2, d=64, page=64, capacity=1000, window=(300, 0), s_new=200,
           rotary="halves"),
    # pages larger than the key tile; not causal
    KVCase(b=2, s_q=130, h=8, h_k=8, d=128, page=256, capacity=1024),
    KVCase(b=3, s_q=128, h=8, h_k=2, d=256, page=8, capacity=700, causal=True, empty_seq=True,
           dtype=FP16),
    # more queries than some sequences' keys (rows that see nothing: out 0, LSE -inf)
    KVCase(b=2, s_q=300, h=8, h_k=4, d=128, page=32, capacity=256, causal=True),
    # softcap (the dense kernel's tanh before the softmax)
    KVCase(b=2, s_q=192, h=16, h_k=4, d=128, page=16, capacity=900, causal=True, s_new=192,
           softcap=30.0),
    KVCase(b=2, s_q=130, h=8, h_k=8, d=64, page=64, capacity=500, softcap=5.0, dtype=FP16),
]


def _count_calls(monkeypatch) -> list:
    calls = []
    orig = sm90_fwd.attn_fwd_sm90_paged
    monkeypatch.setattr(sm90_fwd, "attn_fwd_sm90_paged",
                        lambda *a: calls.append(1) or orig(*a))
    return calls


@needs_sm90
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_sm90_paged(c: KVCase, monkeypatch):
    monkeypatch.setattr(op, "FORCE_SM90_PAGED", True)  # past the launch-shape guards
    calls = _count_calls(monkeypatch)
    check_against_ref(c, "cuda")
    assert calls, "the sm90 paged forward was not taken"


@needs_sm90
def test_sm90_paged_ignores_stale_slots(monkeypatch):
    """Page slots past each sequence's keys (stale entries of a reused page: NaN here) never
    reach the outputs: the tile that crosses the end has those rows zeroed before P·V."""
    monkeypatch.setattr(op, "FORCE_SM90_PAGED", True)
    calls = _count_calls(monkeypatch)
    c = KVCase(b=3, s_q=160, h=8, h_k=2, d=128, page=16, capacity=600, causal=True)
    q, k_cache, v_cache, kw, opts = _build(c, "cuda")
    table, lens = kw["block_table"].long(), kw["cache_seqlens"].long()
    for i in range(c.b):
        pos = torch.arange(int(lens[i]), table.shape[1] * c.page, device="cuda")
        k_cache[table[i, pos // c.page], pos % c.page] = float("nan")
        v_cache[table[i, pos // c.page], pos % c.page] = float("nan")
    ref, _, _, _ = kvcache_attention_ref(q, k_cache, v_cache, **kw, **opts)
    pt, _, _, _ = kvcache_attention_ref(q, k_cache, v_cache, **kw, **opts, upcast=False)
    out = ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts)
    assert calls
    assert torch.isfinite(out).all()
    assert_close_rule("out", out, ref, pt)


@needs_sm90
def test_sm90_paged_not_taken_where_not_covered(monkeypatch):
    """Page sizes that are not whole TMA boxes (1, 3, 5...), backend='triton' and decode-sized
    chunks stay on the portable paths (ALiBi and leftpad: ``test_sm90_paged_coverage_rules``)."""
    calls = _count_calls(monkeypatch)
    for c, kwargs in ((KVCase(b=2, s_q=160, h=8, h_k=2, d=128, page=5, capacity=400), {}),
                      (KVCase(b=2, s_q=160, h=8, h_k=2, d=128, page=16, capacity=400),
                       dict(backend="triton")),
                      (KVCase(b=2, s_q=4, h=8, h_k=2, d=128, page=16, capacity=400), {})):
        q, k_cache, v_cache, kw, opts = _build(c, "cuda")
        ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts, **kwargs)
    assert not calls
    monkeypatch.setattr(op, "FORCE_SM90_PAGED", False)
    c = KVCase(b=2, s_q=160, h=8, h_k=2, d=128, page=16, capacity=400)
    q, k_cache, v_cache, kw, opts = _build(c, "cuda")
    ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts)
    assert not calls


def test_sm90_paged_coverage_rules():
    """``paged_unsupported_reason`` (host-side, any machine): contiguous K and V page pools with
    pages that are whole TMA boxes are covered; FlashInfer's interleaved cache, odd page sizes,
    ALiBi / leftpad, contiguous caches and other head dims are not, each with a reason; softcap
    is covered."""
    bf16 = torch.bfloat16

    def reason(page=16, d=128, interleaved=False, table=True, **kw):
        q = torch.empty(2, 256, 8, d, dtype=bf16, device="meta")
        if interleaved:
            cache = torch.empty(40, 2, page, 2, d, dtype=bf16, device="meta")
            k, v = cache[:, 0], cache[:, 1]
        else:
            k, v = (torch.empty(40, page, 2, d, dtype=bf16, device="meta") for _ in range(2))
        bt = torch.empty(2, 8, dtype=torch.int32, device="meta") if table else None
        args = dict(softcap=0.0, has_alibi=False, has_leftpad=False, has_cache_idx=False) | kw
        return sm90_fwd.paged_unsupported_reason(q, k, v, bt, **args)

    for page, d in ((8, 128), (16, 64), (64, 128), (256, 128), (32, 256)):
        assert reason(page, d) is None, (page, d)
    assert reason(softcap=5.0) is None
    for why, r in (("page 5", reason(5)), ("page 12", reason(12)), ("d 96", reason(16, 96)),
                   ("interleaved", reason(interleaved=True)), ("contiguous", reason(table=False)),
                   ("alibi", reason(has_alibi=True)),
                   ("leftpad", reason(has_leftpad=True))):
        assert isinstance(r, str) and r, why

"""Cascade merges (``ioattn.flashinfer.merge_state`` / ``merge_state_in_place`` /
``merge_states``): against an fp64 reference, with empty states (LSE -inf), masks, many states,
odd head dims; and the cascade identity: attention over two key sets merged equals attention
over their union."""
from __future__ import annotations

import pytest
import torch

import ioattn.flashinfer as fi


def _states(n, seq, h, d, dtype, device, empty=True):
    v = torch.randn(seq, n, h, d, device=device).to(dtype)
    s = torch.randn(seq, n, h, device=device) * 4
    if empty and seq > 2:
        s[1] = float("-inf")  # a position with no key in any state
        s[2, 0] = float("-inf")  # one empty state
    return v, s


def _ref(v, s):
    """fp64 merge over dim 1; all-empty positions give 0 and -inf."""
    s64 = s.double()
    m = s64.max(1, keepdim=True).values
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp2(s64 - m)
    l = w.sum(1)
    out = (w[..., None] * v.double()).sum(1) / torch.where(l == 0, 1.0, l)[..., None]
    return out, torch.where(l == 0, float("-inf"), m[:, 0] + torch.log2(torch.where(l == 0, 1.0, l)))


def _close(name, got_v, got_s, ref_v, ref_s, dtype):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got_v.double(), ref_v, atol=tol, rtol=tol, msg=name)
    assert torch.equal(torch.isinf(got_s), torch.isinf(ref_s)), name
    fin = ~torch.isinf(ref_s)
    torch.testing.assert_close(got_s.double()[fin], ref_s[fin], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 128), (torch.float16, 96),
                                      (torch.float32, 64)])
def test_merge_state(dtype, d, device):
    v, s = _states(2, 37, 3, d, dtype, device)
    got_v, got_s = fi.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    assert got_v.dtype == dtype and got_s.dtype == torch.float32
    _close("merge_state", got_v, got_s, *_ref(v, s), dtype)


def test_merge_state_in_place_with_mask(device):
    v, s = _states(2, 19, 4, 64, torch.bfloat16, device)
    a_v, a_s = v[:, 0].contiguous(), s[:, 0].contiguous()
    before_v, before_s = a_v.clone(), a_s.clone()
    mask = torch.rand(19, device=device) < 0.5
    fi.merge_state_in_place(a_v, a_s, v[:, 1], s[:, 1], mask=mask)
    ref_v, ref_s = _ref(v, s)
    _close("in place, masked rows", a_v[mask], a_s[mask], ref_v[mask], ref_s[mask], torch.bfloat16)
    assert torch.equal(a_v[~mask], before_v[~mask]) and torch.equal(a_s[~mask], before_s[~mask])
    fi.merge_state_in_place(before_v, before_s, v[:, 1], s[:, 1])
    _close("in place", before_v, before_s, ref_v, ref_s, torch.bfloat16)


@pytest.mark.parametrize("n", [1, 7, 20])  # 20 > the 16 states merged per step
def test_merge_states(n, device):
    v, s = _states(n, 11, 2, 80, torch.float16, device)
    got_v, got_s = fi.merge_states(v, s)
    assert got_v.shape == (11, 2, 80) and got_s.shape == (11, 2)
    _close("merge_states", got_v, got_s, *_ref(v, s), torch.float16)


def test_cascade_identity(device):
    """Attention over a shared prefix and a suffix, merged, equals attention over both: the
    base-2 LSE that ``single_prefill_with_kv_cache`` returns is the one the merges expect."""
    dtype = torch.float16
    q = torch.randn(5, 4, 64, device=device, dtype=dtype)
    k = torch.randn(50, 2, 64, device=device, dtype=dtype)
    v = torch.randn(50, 2, 64, device=device, dtype=dtype)
    o1, s1 = fi.single_prefill_with_kv_cache(q, k[:30], v[:30], return_lse=True)
    o2, s2 = fi.single_prefill_with_kv_cache(q, k[30:], v[30:], return_lse=True)
    whole, s_whole = fi.single_prefill_with_kv_cache(q, k, v, return_lse=True)
    got_v, got_s = fi.merge_state(o1, s1, o2, s2)
    torch.testing.assert_close(got_v.float(), whole.float(), atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(got_s, s_whole, atol=1e-3, rtol=1e-3)
    o2_again, s2_again = fi.single_prefill_with_kv_cache_return_lse(q, k[30:], v[30:])
    assert torch.equal(o2_again, o2) and torch.equal(s2_again, s2)
    stacked_v, stacked_s = fi.merge_states(torch.stack([o1, o2], 1), torch.stack([s1, s2], 1))
    torch.testing.assert_close(stacked_v.float(), got_v.float(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("call, match", [
    (lambda t: fi.merge_state(t["v"], t["s"], t["v"][:, :1], t["s"][:, :1]), "must match"),
    (lambda t: fi.merge_state(t["v"], t["s"].half(), t["v"], t["s"]), "float32"),
    (lambda t: fi.merge_state(t["v"].int(), t["s"], t["v"], t["s"]), "float16"),
    (lambda t: fi.merge_state(t["v"], t["s"][:, 0], t["v"], t["s"]), "seq_len, num_heads"),
    (lambda t: fi.merge_states(t["v"], t["s"]), "num_states"),
    (lambda t: fi.merge_state_in_place(t["v"], t["s"], t["v"], t["s"], mask=(t["s"][:, 0] > 0).int()),
     "bool tensor"),
    (lambda t: fi.merge_state_in_place(t["v"].transpose(0, 1), t["s"].t(), t["v"].transpose(0, 1),
                                       t["s"].t()), "contiguous"),
])
def test_merge_errors(call, match, device):
    t = dict(v=torch.randn(6, 3, 64, device=device), s=torch.randn(6, 3, device=device))
    with pytest.raises((ValueError, TypeError), match=match):
        call(t)


def _csr(page_lists, page, lens):
    indptr = torch.tensor([0] + torch.tensor([len(p) for p in page_lists]).cumsum(0).tolist(),
                          dtype=torch.int32)
    indices = torch.tensor([p for ps in page_lists for p in ps], dtype=torch.int32)
    last = torch.tensor([n - (len(ps) - 1) * page for n, ps in zip(lens, page_lists)],
                        dtype=torch.int32)
    return indptr, indices, last


@pytest.mark.parametrize("qo_lens, causal", [([1, 1, 1], False), ([3, 1, 4], True)],
                         ids=["decode", "append-causal"])
def test_multi_level_cascade(qo_lens, causal, device):
    """Three levels over one cache: a prefix shared by all requests, one shared by the first two,
    each request's own pages; against attention over each request's whole key sequence."""
    from ioattn.reference import attention_ref

    page, h, h_k, d, dtype = 4, 4, 2, 64, torch.float16
    cache = torch.randn(40, 2, page, h_k, d, device=device, dtype=dtype)
    perm = torch.randperm(40).tolist()
    shared = perm[:3]  # 12 keys
    pair = perm[3:5]  # 7 keys (its last page holds 3)
    own = [perm[5:8], perm[8:10], perm[10:11]]
    own_lens = [10, 5, 4]
    b, total_q = len(qo_lens), sum(qo_lens)
    qo = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    # level 0: every query, as one request, over `shared`; level 1: requests 0 and 1 (as one
    # request) over `pair`, request 2 over nothing; level 2: each request over its own pages
    qo_arr = [torch.tensor([0, total_q], dtype=torch.int32),
              torch.tensor([0, qo_lens[0] + qo_lens[1], total_q], dtype=torch.int32), qo]
    tables = [_csr([shared], page, [12]),
              (torch.tensor([0, 2, 2], dtype=torch.int32), torch.tensor(pair, dtype=torch.int32),
               torch.tensor([3, 0], dtype=torch.int32)),
              _csr(own, page, own_lens)]
    w = fi.MultiLevelCascadeAttentionWrapper(3, torch.empty(32 << 20, dtype=torch.uint8, device=device))
    w.plan(qo_arr, [t[0] for t in tables], [t[1].to(device) for t in tables],
           [t[2] for t in tables], h, h_k, d, page, causal=causal, q_data_type=dtype)
    q = torch.randn(total_q, h, d, device=device, dtype=dtype)
    out = w.run(q, cache)
    k_all, v_all = cache[:, 0], cache[:, 1]
    for r in range(b):
        parts = [shared] + ([pair] if r < 2 else []) + [own[r]]
        counts = [12] + ([7] if r < 2 else []) + [own_lens[r]]
        keys = torch.cat([k_all[p].flatten(0, 1)[:n] for p, n in zip(parts, counts)])
        vals = torch.cat([v_all[p].flatten(0, 1)[:n] for p, n in zip(parts, counts)])
        rows = slice(int(qo[r]), int(qo[r + 1]))
        ref, _ = attention_ref(q[rows][None], keys[None], vals[None], causal=causal)
        torch.testing.assert_close(out[rows].float(), ref[0].float(), atol=4e-3, rtol=4e-3)


def test_prefill_more_queries_than_keys(device):
    """Without a causal mask (a cascade level) a request may have more queries than keys, or no
    key at all (out 0, LSE -inf); with causal=True that is refused with a clear error."""
    page, h, d = 4, 2, 64
    cache = torch.randn(6, 2, page, h, d, device=device, dtype=torch.float16)
    qo = torch.tensor([0, 5, 8], dtype=torch.int32)
    indptr = torch.tensor([0, 1, 1], dtype=torch.int32)
    indices = torch.tensor([3], dtype=torch.int32, device=device)
    last = torch.tensor([2, 0], dtype=torch.int32)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="causal=True"):
        w.plan(qo, indptr, indices, last, h, h, d, page, causal=True, q_data_type=torch.float16)
    w.plan(qo, indptr, indices, last, h, h, d, page, causal=False, q_data_type=torch.float16)
    q = torch.randn(8, h, d, device=device, dtype=torch.float16)
    out, lse = w.run(q, cache, return_lse=True)
    from ioattn.reference import attention_ref

    ref, _ = attention_ref(q[None, :5], cache[3, 0, :2][None], cache[3, 1, :2][None])
    torch.testing.assert_close(out[:5].float(), ref[0].float(), atol=4e-3, rtol=4e-3)
    assert (out[5:] == 0).all() and torch.isinf(lse[5:]).all()

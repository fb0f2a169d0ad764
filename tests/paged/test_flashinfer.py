"""ioattn.flashinfer against references built by gathering each request's pages into contiguous
K/V (FlashAttention's tolerance rule); LSE in base 2 as FlashInfer."""
from __future__ import annotations

import math

import pytest
import torch

import ioattn.flashinfer as fi
from ioattn.reference import attention_ref
from ioattn.testing import OUT_FACTOR, assert_close_rule
from tests.conftest import ON_GPU

BF16, FP16 = torch.bfloat16, torch.float16


def _paged(batch, h_k, d, page, dtype, device, layout="NHD", max_len=120, empty=True, g=None):
    lens = torch.randint(1, max_len, (batch,), generator=g).tolist()
    if empty and batch > 2:
        lens[1] = 0  # a request with no pages
    pages = [(n + page - 1) // page for n in lens]
    n_pages = sum(pages) + 3
    perm = torch.randperm(n_pages, generator=g)[:sum(pages)].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page if p else 0 for n, p in zip(lens, pages)], dtype=torch.int32)
    shape = (n_pages, 2, page, h_k, d) if layout == "NHD" else (n_pages, 2, h_k, page, d)
    cache = torch.randn(shape, device=device, dtype=dtype)
    return lens, indptr, perm, last, cache


def _check_rotated(name, got, q_rows, k, v, cos, sin, **kw):
    """``_check_request`` for RoPE_LLAMA: keys at positions 0..n-1, queries at the last ones.
    The reference attends over q/k rotated in fp32; the low-precision baseline over the same
    rotated values rounded to bf16, as the kernels round them. The kernels' rotation (their own
    angles, FMAs) rounds some elements the other way, an error independent of the baseline's:
    factor 3 instead of 2 (factor 2 failed ~1 run in 8 on single-row decode by <10%)."""
    from ioattn.reference import rotary_ref

    n, m = k.shape[0], q_rows.shape[0]
    kr = rotary_ref(k.float(), cos, sin, torch.arange(n, device=k.device), False)
    qr = rotary_ref(q_rows.float(), cos, sin, torch.arange(n - m, n, device=k.device), False)
    ref, _ = attention_ref(qr[None], kr[None], v[None].float(), **kw)
    pt, _ = attention_ref(qr[None].to(v.dtype), kr[None].to(v.dtype), v[None], upcast=False, **kw)
    assert_close_rule(name, got, ref[0], pt[0], factor=3.0)


def _check_request(name, got, q_rows, k, v, factor=OUT_FACTOR, **kw):
    """One request's output rows (q_rows [rows, h, d] over k, v [n, h_k, d]) against the fp32
    reference with FlashAttention's rule; returns the reference LSE [h, rows] (natural log)."""
    ref, lse_ref = attention_ref(q_rows[None], k[None], v[None], **kw)
    pt, _ = attention_ref(q_rows[None], k[None], v[None], upcast=False, **kw)
    assert_close_rule(name, got, ref[0], pt[0], factor=factor)
    return lse_ref[0]


def _gather(cache, layout, indices, indptr, b, n):
    k, v = cache[:, 0], cache[:, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    rows = indices[indptr[b]:indptr[b + 1]].long()
    kk = k[rows].flatten(0, 1)[:n]
    vv = v[rows].flatten(0, 1)[:n]
    return kk, vv


CASES = [
    dict(batch=4, h=8, h_k=2, d=64, page=16, layout="NHD"),
    dict(batch=3, h=5, h_k=1, d=64, page=1, layout="HND", dtype=FP16),
    dict(batch=5, h=4, h_k=4, d=96, page=3, layout="NHD", window_left=20),
    dict(batch=2, h=7, h_k=1, d=64, page=7, layout="HND", softcap=4.0),
    dict(batch=3, h=32, h_k=8, d=128, page=16, layout="NHD", split=8),
    dict(batch=2, h=16, h_k=1, d=64, page=64, layout="HND"),
    dict(batch=2, h=32, h_k=1, d=256, page=16, layout="NHD", max_len=70),
    dict(batch=3, h=12, h_k=2, d=64, page=5, layout="NHD", split=16),
]
if ON_GPU:
    CASES += [dict(batch=64, h=32, h_k=8, d=128, page=16, layout="NHD", max_len=4096),
              dict(batch=2, h=32, h_k=4, d=256, page=64, layout="HND", max_len=3000),
              dict(batch=16, h=16, h_k=2, d=128, page=1, layout="NHD", max_len=1000)]


@pytest.mark.parametrize("c", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_batch_decode(c, device):
    c = dict(c)
    dtype = c.pop("dtype", BF16)
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    lens, indptr, indices, last, cache = _paged(c["batch"], c["h_k"], c["d"], c["page"], dtype,
                                                device, c["layout"], c.get("max_len", 120), g=g)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(32 << 20, dtype=torch.uint8, device=device), kv_layout=c["layout"])
    wl, cap = c.get("window_left", -1), c.get("softcap", 0.0)
    wrapper.plan(indptr, indices.to(device), last, c["h"], c["h_k"], c["d"], c["page"],
                 window_left=wl, logits_soft_cap=cap or None, q_data_type=dtype,
                 fixed_split_size=c.get("split"))
    q = torch.randn(c["batch"], c["h"], c["d"], device=device, dtype=dtype)
    out, lse = wrapper.run(q, cache, return_lse=True)
    for b, n in enumerate(lens):
        k, v = _gather(cache, c["layout"], indices, indptr, b, n)
        kw = dict(window_size=(wl, -1), softcap=cap)
        lse_ref = _check_request(f"out[{b}]", out[b:b + 1], q[b:b + 1], k, v, **kw)
        if n == 0:
            assert (out[b] == 0).all() and torch.isinf(lse[b]).all()
        else:
            torch.testing.assert_close(lse[b], lse_ref[:, 0] / math.log(2), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("c", [CASES[0], CASES[1], CASES[2], CASES[5]],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_batch_decode_balanced(c, device, monkeypatch):
    """The balanced split (IOATTN_SM90_DECODE_BALANCED): the same outputs as the reference, on
    whichever kernel runs the plan (its pieces are work items; on Hopper the sm90 kernel loops
    over each column's where it covers the call). Few SMs, so that requests are cut into many
    pieces."""
    from ioattn.decode import triton_decode

    monkeypatch.setattr(triton_decode, "SM90_DECODE_BALANCED", True)
    monkeypatch.setattr(fi, "sm_count", lambda device: 3)
    test_batch_decode(c, device)


def test_batch_decode_replans(device):
    """One eager wrapper planned again and again, as an engine plans every step: its page table
    is copied into a buffer of the wrapper's own, grown geometrically (the kernels take its size
    as a bound, stale entries past the plan's pages unread), whose address stays while the plans
    fit (run()'s kept sm90 launches key on it); each plan's outputs against the references."""
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(32 << 20, dtype=torch.uint8, device=device))
    tables = []
    for batch, max_len, page in ((3, 60, 4), (8, 900, 1), (3, 200, 4)):
        g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
        lens, indptr, indices, last, cache = _paged(batch, 2, 64, page, BF16, device,
                                                    max_len=max_len, g=g)
        wrapper.plan(indptr, indices.to(device), last, 4, 2, 64, page, q_data_type=BF16)
        q = torch.randn(batch, 4, 64, device=device, dtype=BF16)
        out = wrapper.run(q, cache)
        for b, n in enumerate(lens):
            k, v = _gather(cache, "NHD", indices, indptr, b, n)
            _check_request(f"plan {len(tables)} out[{b}]", out[b:b + 1], q[b:b + 1], k, v)
        tables.append((wrapper._indices.data_ptr(), wrapper._indices.numel(), indices.numel()))
    (p0, n0, need0), (p1, n1, need1), (p2, n2, need2) = tables
    assert n0 == max(need0, 1024), tables
    if need1 > n0:  # (almost always: 7 requests of up to 900 one-key pages) grown
        assert n1 >= max(need1, 2 * n0), tables
    else:
        assert (p1, n1) == (p0, n0), tables
    assert need2 <= n1 and (p2, n2) == (p1, n1), tables  # (fits: the same buffer)


def test_balanced_plan():
    """split_work_balanced: each request's keys covered once, in order, cut on 64-key tiles;
    columns of equal tiles (within one); split requests' slots consecutive; at most
    columns + batch items, inside the bound the wrapper's buffers are sized by."""
    from ioattn.paged.plan import balanced_columns, max_work_items, split_work_balanced

    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    cases = [[4096] * 64, [8192] * 16, [32768], [0, 5, 700, 0, 64, 129], [1] * 300, [0, 0],
             torch.randint(0, 5000, (37,), generator=g).tolist()]
    for lengths in cases:
        for h_k, sms in ((8, 132), (2, 132), (1, 3), (4, 1)):
            plan = split_work_balanced(lengths, h_k, sms)
            cols = balanced_columns(h_k, sms)
            assert len(plan.columns) == cols + 1 and plan.columns[0] == 0
            assert plan.columns[-1] == len(plan.work) <= max_work_items(len(lengths), h_k, sms)
            assert all(a <= b for a, b in zip(plan.columns, plan.columns[1:]))
            keys = {b: 0 for b in range(len(lengths))}
            for b, row, lo, hi, slot in plan.work:
                assert row == 0 and lo == keys[b] and lo % 64 == 0 and hi <= max(lengths[b], 0)
                keys[b] = hi
            assert all(keys[b] == n for b, n in enumerate(lengths))
            tiles = [sum(-(-(hi - lo) // 64) for _, _, lo, hi, _ in plan.work[a:e])
                     for a, e in zip(plan.columns, plan.columns[1:])]
            assert max(tiles) - min(tiles) <= 1, tiles
            for b in range(len(lengths)):
                items = [w for w in plan.work if w[0] == b]
                slots = [w[4] for w in items]
                if len(items) == 1:
                    assert slots == [-1] and plan.slot_start[b] == plan.slot_start[b + 1]
                else:
                    assert slots == list(range(plan.slot_start[b], plan.slot_start[b + 1]))


def test_split_plan():
    """split_work: each request's keys covered once, in order; split requests' slots
    consecutive; at most max_work_items items (the bound a captured graph launches); a fixed
    chunk honoured; and the split chosen by waves of CTAs (two per SM): on 132 SMs with 8 KV
    heads, 16 x 8k runs unsplit (128 CTAs; the old rule's 384 left a second wave of 120 that
    ran 15% slower on the H200), 1 x 32k in 32 pieces (256 CTAs), 48 x 4k in 96 (768 CTAs)."""
    from ioattn.paged.plan import max_work_items, split_work

    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    cases = [[4096] * 64, [8192] * 16, [32768], [0, 5, 700, 0, 64, 129], [1] * 300, [0, 0],
             torch.randint(0, 20000, (37,), generator=g).tolist(),
             torch.randint(0, 9000, (5,), generator=g).tolist()]
    for lengths in cases:
        for h_k, sms in ((8, 132), (2, 132), (1, 3), (4, 1)):
            for fixed in (None, 1000):
                plan = split_work(lengths, h_k, sms, fixed_chunk=fixed)
                assert 0 < len(plan.work) <= max(max_work_items(len(lengths), h_k, sms),
                                                 sum(-(-n // 1000) for n in lengths) + 2)
                if fixed is None:
                    assert len(plan.work) <= max_work_items(len(lengths), h_k, sms)
                keys = {b: 0 for b in range(len(lengths))}
                for b, row, lo, hi, slot in plan.work:
                    assert row == 0 and lo == keys[b] and lo < hi or lengths[b] == hi == lo == 0
                    assert fixed is None or hi - lo <= fixed
                    keys[b] = hi
                assert all(keys[b] == n for b, n in enumerate(lengths))
                for b in range(len(lengths)):
                    slots = [w[4] for w in plan.work if w[0] == b]
                    if len(slots) == 1:
                        assert slots == [-1] and plan.slot_start[b] == plan.slot_start[b + 1]
                    else:
                        assert slots == list(range(plan.slot_start[b], plan.slot_start[b + 1]))
    for lengths, items in (([8192] * 16, 16), ([32768], 32), ([4096] * 48, 96), ([4096] * 64, 64),
                           ([2048] * 128, 128), ([8192] * 8, 24)):
        assert len(split_work(lengths, 8, 132).work) == items, lengths[:1] * len(lengths)


def test_graph_wrapper_plan_fixes_its_launch(device, monkeypatch):
    """A use_cuda_graph wrapper refuses, before replacing any buffer a captured graph reads, a
    later plan with another batch size, KV head count or split mode (balanced or fixed)."""
    from ioattn.decode import triton_decode

    monkeypatch.setattr(triton_decode, "SM90_DECODE_BALANCED", True)
    g = torch.Generator().manual_seed(2)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(8 << 20, dtype=torch.uint8, device=device), use_cuda_graph=True,
        paged_kv_indices_buffer=torch.empty(1000, dtype=torch.int32, device=device))
    lens, indptr, indices, last, cache = _paged(3, 2, 64, 4, BF16, device, max_len=50, g=g)
    wrapper.plan(indptr, indices.to(device), last, 4, 2, 64, 4, q_data_type=BF16)
    bufs = (wrapper._work, wrapper._slot_start, wrapper._columns, wrapper._counts)
    for kw, match in ((dict(num_kv_heads=1, num_qo_heads=4), "KV head count"),
                      (dict(fixed_split_size=16), "split mode")):
        args = dict(num_qo_heads=4, num_kv_heads=2)
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            wrapper.plan(indptr, indices.to(device), last, args["num_qo_heads"],
                         args["num_kv_heads"], 64, 4, q_data_type=BF16,
                         fixed_split_size=args.get("fixed_split_size"))
        assert all(a is b for a, b in zip(bufs, (wrapper._work, wrapper._slot_start,
                                                 wrapper._columns, wrapper._counts)))


def test_plan_reuse_with_new_lengths(device):
    """run() after a second plan with other lengths (what a CUDA graph replay does) is right, and
    the buffers it launches on keep their addresses."""
    g = torch.Generator().manual_seed(1)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(8 << 20, dtype=torch.uint8, device=device), use_cuda_graph=True,
        paged_kv_indices_buffer=torch.empty(1000, dtype=torch.int32, device=device))
    addrs = None
    for max_len in (20, 300):
        lens, indptr, indices, last, cache = _paged(3, 2, 64, 4, BF16, device, max_len=max_len, g=g)
        wrapper.plan(indptr, indices.to(device), last, 4, 2, 64, 4, q_data_type=BF16)
        now = (wrapper._work.data_ptr(), wrapper._o_part.data_ptr(), wrapper._seqlens_indptr.data_ptr(),
               wrapper._indices.data_ptr())
        assert addrs is None or now == addrs
        addrs = now
        q = torch.randn(3, 4, 64, device=device, dtype=BF16)
        out = wrapper.run(q, cache)
        for b, n in enumerate(lens):
            k, v = _gather(cache, "NHD", indices, indptr, b, n)
            _check_request(f"out[{b}]", out[b:b + 1], q[b:b + 1], k, v)


def test_single_decode(device):
    q = torch.randn(8, 64, device=device, dtype=BF16)
    k = torch.randn(77, 2, 64, device=device, dtype=BF16)
    v = torch.randn(77, 2, 64, device=device, dtype=BF16)
    out, lse = fi.single_decode_with_kv_cache(q, k, v, return_lse=True)
    lse_ref = _check_request("out", out[None], q[None], k, v)
    torch.testing.assert_close(lse, lse_ref[:, 0] / math.log(2), atol=1e-3, rtol=1e-3)
    out_hnd = fi.single_decode_with_kv_cache(q, k.transpose(0, 1).contiguous(),
                                             v.transpose(0, 1).contiguous(), kv_layout="HND")
    torch.testing.assert_close(out_hnd, out, atol=0, rtol=0)


def test_append_paged_kv_cache(device):
    g = torch.Generator().manual_seed(2)
    lens, indptr, indices, last, cache = _paged(3, 2, 64, 5, BF16, device, max_len=40, empty=False, g=g)
    new = torch.tensor([3, 0, 2])
    # room: the table already covers lens; append within the allocated pages' capacity
    cap = ((indptr[1:] - indptr[:-1]) * 5).tolist()
    seq_after = [min(n + a, c_) for n, a, c_ in zip(lens, new.tolist(), cap)]
    counts = [s_ - n for s_, n in zip(seq_after, lens)]
    append_indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=device)
    nnz = sum(counts)
    kn = torch.randn(nnz, 2, 64, device=device, dtype=BF16)
    vn = torch.randn(nnz, 2, 64, device=device, dtype=BF16)
    bi, pos = fi.get_batch_indices_positions(append_indptr, torch.tensor(seq_after, dtype=torch.int32, device=device), nnz)
    before = cache.clone()
    fi.append_paged_kv_cache(kn, vn, bi, pos, cache, indices.to(device), indptr.to(device), last.to(device))
    i = 0
    for b in range(3):
        for t in range(counts[b]):
            p_ = lens[b] + t
            page = int(indices[indptr[b] + p_ // 5])
            assert torch.equal(cache[page, 0, p_ % 5], kn[i]) and torch.equal(cache[page, 1, p_ % 5], vn[i])
            before[page, :, p_ % 5] = cache[page, :, p_ % 5]
            i += 1
    assert torch.equal(before, cache), "only the appended slots change"
    torch.testing.assert_close(fi.get_seq_lens(indptr, last, 5), torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize("bad, match", [
    ("indptr_dtype", "int32"), ("last_page_len", "last_page_len"), ("heads", "multiple"),
    ("rope", "pos_encoding_mode"), ("indptr_order", "non-decreasing"),
])
def test_plan_errors(bad, match, device):
    lens, indptr, indices, last, cache = _paged(3, 2, 64, 4, BF16, device)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    kw = dict(pos_encoding_mode="NONE")
    h = 4
    if bad == "indptr_dtype":
        indptr = indptr.long()
    if bad == "last_page_len":
        last = last.clone()
        last[0] = 5
    if bad == "heads":
        h = 3
    if bad == "rope":
        kw["pos_encoding_mode"] = "ALIBI"
    if bad == "indptr_order":
        indptr = indptr.flip(0)
    with pytest.raises((ValueError, TypeError), match=match):
        w.plan(indptr, indices.to(device), last, h, 2, 64, 4, q_data_type=BF16, **kw)


def test_graph_buffers_checked(device):
    """Fixed buffers for CUDA-graph mode must be int32 and on the workspace's device."""
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    with pytest.raises(TypeError, match="paged_kv_indices_buffer"):
        fi.BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True,
                                              paged_kv_indices_buffer=torch.empty(8, device=device))
    lens, indptr, indices, last, cache = _paged(2, 2, 64, 4, BF16, device, empty=False)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, use_cuda_graph=True,
                                               paged_kv_indices_buf=torch.empty(1, dtype=torch.int32,
                                                                                device=device))
    qo_indptr = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="paged_kv_indices_buf must be"):  # 1 entry, 2+ pages
        w.plan(qo_indptr, indptr, indices.to(device), last, 4, 2, 64, 4, q_data_type=BF16)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_short_replay_long():
    """Capture run() once at short lengths, then re-plan with long lengths and replay: the output
    follows the new plan (buffers keep their addresses, the grid covers any plan)."""
    device = "cuda"
    g = torch.Generator().manual_seed(3)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device=device), use_cuda_graph=True,
        paged_kv_indices_buffer=torch.empty(4000, dtype=torch.int32, device=device))
    b, h, h_k, d, page = 8, 32, 8, 128, 16
    q = torch.randn(b, h, d, device=device, dtype=BF16)
    out = torch.empty_like(q)
    lens, indptr, indices, last, cache = _paged(b, h_k, d, page, BF16, device, max_len=40, empty=False, g=g)
    big = torch.randn(4000, 2, page, h_k, d, device=device, dtype=BF16)
    big[:cache.shape[0]] = cache
    wrapper.plan(indptr, indices.to(device), last, h, h_k, d, page, q_data_type=BF16)
    wrapper.run(q, big, out=out)  # warm-up (compiles) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, big, out=out)
    replay_long_and_check(wrapper, graph, g, q, out, big, h_k, page)


def replay_long_and_check(wrapper, graph, g, q, out, big, h_k, page):
    """Re-plan a captured decode wrapper with 2000-3000 keys per request over the 4000 pages of
    ``big``, replay the graph and check every request's output."""
    b, h, d = q.shape
    lens2 = torch.randint(2000, 3000, (b,), generator=g).tolist()
    pages = [(n + page - 1) // page for n in lens2]
    perm = torch.randperm(4000, generator=g)[:sum(pages)].to(torch.int32)
    indptr2 = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last2 = torch.tensor([n - (p - 1) * page for n, p in zip(lens2, pages)], dtype=torch.int32)
    wrapper.plan(indptr2, perm.to(q.device), last2, h, h_k, d, page, q_data_type=q.dtype)
    graph.replay()
    torch.cuda.synchronize()
    for i, n in enumerate(lens2):
        k, v = _gather(big, "NHD", perm, indptr2, i, n)
        _check_request(f"out[{i}]", out[i:i + 1], q[i:i + 1], k, v)


def _prefill_plan(w, g, device, b, total_q, page, h, h_k, d, cache_pages, masked=False,
                  max_len=60):
    """A random paged prefill plan of ``b`` requests with ``total_q`` queries in all, over pages
    of a cache of ``cache_pages`` pages; returns what the reference check needs."""
    lens = torch.randint(total_q, total_q + max_len, (b,), generator=g).tolist()
    cuts = sorted(torch.randint(0, total_q + 1, (b - 1,), generator=g).tolist())
    qo = [e - s_ for s_, e in zip([0] + cuts, cuts + [total_q])]
    pages = [(n + page - 1) // page for n in lens]
    indices = torch.randperm(cache_pages, generator=g)[:sum(pages)].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)], dtype=torch.int32)
    qo_indptr = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32)
    masks = _masks(qo, lens, g) if masked else None
    kw = dict(custom_mask=torch.cat([m.flatten() for m in masks]).to(device)) if masked else dict(causal=True)
    w.plan(qo_indptr, indptr, indices.to(device), last, h, h_k, d, page, q_data_type=BF16, **kw)
    return lens, qo_indptr, indptr, indices, masks


def _check_prefill(out, q, cache, lens, qo_indptr, indptr, indices, masks):
    for b, n in enumerate(lens):
        k, v = _gather(cache, "NHD", indices, indptr, b, n)
        sl = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        kw = dict(attn_mask=masks[b]) if masks else dict(causal=True)
        _check_request(f"out[{b}]", out[sl], q[sl], k, v, **kw)


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "custom-mask"])
def test_prefill_graph_mode_replans_in_place(masked, device):
    """use_cuda_graph=True: a later plan (same batch and query count, other lengths and splits)
    writes into the same buffers and run() follows it; a plan of another shape is refused."""
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    b, total_q, page, h, h_k, d = 3, 24, 4, 4, 2, 64
    bufs = dict(paged_kv_indices_buf=torch.empty(200, dtype=torch.int32, device=device))
    if masked:
        bufs.update(custom_mask_buf=torch.empty(4000, dtype=torch.uint8, device=device),
                    mask_indptr_buf=torch.empty(b + 1, dtype=torch.int32, device=device))
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                               use_cuda_graph=True, **bufs)
    cache = torch.randn(200, 2, page, h_k, d, device=device, dtype=BF16)
    q = torch.randn(total_q, h, d, device=device, dtype=BF16)
    first = _prefill_plan(w, g, device, b, total_q, page, h, h_k, d, 200, masked)
    ptrs = (w._work.data_ptr(), w._seqlens_indptr.data_ptr(), w._indices.data_ptr())
    _check_prefill(w.run(q, cache), q, cache, *first)
    second = _prefill_plan(w, g, device, b, total_q, page, h, h_k, d, 200, masked, max_len=120)
    assert (w._work.data_ptr(), w._seqlens_indptr.data_ptr(), w._indices.data_ptr()) == ptrs
    _check_prefill(w.run(q, cache), q, cache, *second)
    with pytest.raises(ValueError, match="query count"):
        _prefill_plan(w, g, device, b, total_q + 1, page, h, h_k, d, 200, masked)
    with pytest.raises(ValueError, match="paged_kv_indices_buf"):
        fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, device=device), use_cuda_graph=True)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_prefill_cuda_graph_capture_short_replay_long():
    """The paged prefill wrapper captured at short lengths replays a plan with long ones."""
    device = "cuda"
    g = torch.Generator().manual_seed(4)
    b, total_q, page, h, h_k, d = 4, 256, 16, 32, 8, 128
    w = fi.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device=device), use_cuda_graph=True,
        paged_kv_indices_buf=torch.empty(2000, dtype=torch.int32, device=device))
    cache = torch.randn(2000, 2, page, h_k, d, device=device, dtype=BF16)
    q = torch.randn(total_q, h, d, device=device, dtype=BF16)
    out = torch.empty_like(q)
    _prefill_plan(w, g, device, b, total_q, page, h, h_k, d, 2000, max_len=50)
    w.run(q, cache, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, cache, out=out)
    second = _prefill_plan(w, g, device, b, total_q, page, h, h_k, d, 2000, max_len=6000)
    graph.replay()
    torch.cuda.synchronize()
    _check_prefill(out, q, cache, *second)


def _ragged_plan(w, g, device, b, total_q, total_k, h, h_k, d, masked=False, rope=False):
    """A random ragged plan with fixed totals: each request has at least as many keys as queries."""
    while True:
        cq = sorted(torch.randint(0, total_q + 1, (b - 1,), generator=g).tolist())
        qo = [e - s_ for s_, e in zip([0] + cq, cq + [total_q])]
        extra = sorted(torch.randint(0, total_k - total_q + 1, (b - 1,), generator=g).tolist())
        kv = [q_n + e - s_ for q_n, s_, e in zip(qo, [0] + extra, extra + [total_k - total_q])]
        if all(q_n <= n for q_n, n in zip(qo, kv)):
            break
    qo_indptr = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32)
    kv_indptr = torch.tensor([0] + torch.tensor(kv).cumsum(0).tolist(), dtype=torch.int32)
    masks = _masks(qo, kv, g) if masked else None
    kw = dict(custom_mask=torch.cat([m.flatten() for m in masks]).to(device)) if masked else dict(causal=True)
    if rope:
        kw.update(pos_encoding_mode="ROPE_LLAMA", rope_scale=1.0, rope_theta=1e4)
    w.plan(qo_indptr, kv_indptr, h, h_k, d, q_data_type=BF16, **kw)
    return qo_indptr, kv_indptr, masks


def _check_ragged(out, q, k, v, qo_indptr, kv_indptr, masks, rope=False):
    for b in range(len(qo_indptr) - 1):
        qs = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        ks = slice(int(kv_indptr[b]), int(kv_indptr[b + 1]))
        kw = dict(attn_mask=masks[b]) if masks else dict(causal=True)
        if rope:
            cos, sin = _rope_tables(ks.stop - ks.start + 1, q.shape[-1], 1.0, 1e4, q.device)
            _check_rotated(f"out[{b}]", out[qs], q[qs], k[ks], v[ks], cos, sin, **kw)
        else:
            _check_request(f"out[{b}]", out[qs], q[qs], k[ks], v[ks], **kw)


@pytest.mark.parametrize("mode", ["causal", "custom-mask", "rope"])
def test_ragged_graph_mode_replans_in_place(mode, device):
    """use_cuda_graph=True for the ragged wrapper: later plans with the same batch and totals
    (other splits) reuse the device buffers and run() follows them; other totals are refused."""
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    b, total_q, total_k, h, h_k, d = 3, 20, 50, 4, 2, 64
    bufs = {}
    if mode == "custom-mask":
        bufs = dict(custom_mask_buf=torch.empty(2000, dtype=torch.uint8, device=device),
                    mask_indptr_buf=torch.empty(b + 1, dtype=torch.int32, device=device))
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                use_cuda_graph=True, **bufs)
    q = torch.randn(total_q, h, d, device=device, dtype=BF16)
    k = torch.randn(total_k, h_k, d, device=device, dtype=BF16)
    v = torch.randn(total_k, h_k, d, device=device, dtype=BF16)
    opts = dict(masked=mode == "custom-mask", rope=mode == "rope")
    for _ in range(2):
        plan = _ragged_plan(w, g, device, b, total_q, total_k, h, h_k, d, **opts)
        _check_ragged(w.run(q, k, v), q, k, v, *plan, rope=opts["rope"])
    with pytest.raises(ValueError, match="first plan"):
        _ragged_plan(w, g, device, b, total_q, total_k + 1, h, h_k, d, **opts)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_ragged_cuda_graph_capture_replay():
    """The ragged wrapper captured under one split of the totals replays another."""
    device = "cuda"
    g = torch.Generator().manual_seed(6)
    b, total_q, total_k, h, h_k, d = 4, 512, 3000, 16, 4, 128
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                use_cuda_graph=True)
    q = torch.randn(total_q, h, d, device=device, dtype=BF16)
    k = torch.randn(total_k, h_k, d, device=device, dtype=BF16)
    v = torch.randn(total_k, h_k, d, device=device, dtype=BF16)
    out = torch.empty_like(q)
    _ragged_plan(w, g, device, b, total_q, total_k, h, h_k, d)
    w.run(q, k, v, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, k, v, out=out)
    second = _ragged_plan(w, g, device, b, total_q, total_k, h, h_k, d)
    graph.replay()
    torch.cuda.synchronize()
    _check_ragged(out, q, k, v, *second)


PREFILL_CASES = [
    dict(batch=3, h=4, h_k=2, d=64, page=16, layout="NHD", causal=True),
    dict(batch=4, h=6, h_k=1, d=64, page=3, layout="HND", causal=False, window_left=25),
    dict(batch=2, h=2, h_k=2, d=96, page=1, layout="NHD", causal=True, softcap=5.0, dtype=FP16),
]


@pytest.mark.parametrize("c", PREFILL_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_batch_prefill_paged(c, device):
    c = dict(c)
    dtype = c.pop("dtype", BF16)
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    lens, indptr, indices, last, cache = _paged(c["batch"], c["h_k"], c["d"], c["page"], dtype,
                                                device, c["layout"], 90, empty=False, g=g)
    qo = [int(torch.randint(1, n + 1, (), generator=g)) for n in lens]
    qo[0] = lens[0]  # one request prefills its whole sequence
    qo_indptr = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                               kv_layout=c["layout"])
    wl, cap = c.get("window_left", -1), c.get("softcap", 0.0)
    w.plan(qo_indptr, indptr, indices.to(device), last, c["h"], c["h_k"], c["d"], c["page"],
           causal=c["causal"], window_left=wl, logits_soft_cap=cap or None, q_data_type=dtype)
    q = torch.randn(sum(qo), c["h"], c["d"], device=device, dtype=dtype)
    out, lse = w.run(q, cache, return_lse=True)
    for b, n in enumerate(lens):
        k, v = _gather(cache, c["layout"], indices, indptr, b, n)
        qb = q[qo_indptr[b]:qo_indptr[b + 1]]
        kw = dict(causal=c["causal"], window_size=(wl, -1), softcap=cap)
        sl = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        lse_ref = _check_request(f"out[{b}]", out[sl], qb, k, v, **kw)
        fin = torch.isfinite(lse_ref.t())
        torch.testing.assert_close(lse[sl][fin], (lse_ref.t() / math.log(2))[fin], atol=1e-3, rtol=1e-3)


def test_batch_prefill_ragged_and_single(device):
    g = torch.Generator().manual_seed(5)
    qo, kv = [5, 17, 1], [9, 17, 30]
    cq = torch.tensor([0, 5, 22, 23], dtype=torch.int32)
    ck = torch.tensor([0, 9, 26, 56], dtype=torch.int32)
    q = torch.randn(23, 4, 64, device=device, dtype=BF16)
    k = torch.randn(56, 2, 64, device=device, dtype=BF16)
    v = torch.randn(56, 2, 64, device=device, dtype=BF16)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    w.plan(cq, ck, 4, 2, 64, causal=True, q_data_type=BF16)
    out, lse = w.run(q, k, v, return_lse=True)
    assert lse.shape == (23, 4)
    for b in range(3):
        qs, ks = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        o1, l1 = fi.single_prefill_with_kv_cache(q[qs], k[ks], v[ks], causal=True, return_lse=True)
        lse_ref = _check_request(f"ragged out[{b}]", out[qs], q[qs], k[ks], v[ks], causal=True)
        _check_request(f"single out[{b}]", o1, q[qs], k[ks], v[ks], causal=True)
        torch.testing.assert_close(lse[qs], lse_ref.t() / math.log(2), atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(l1, lse_ref.t() / math.log(2), atol=1e-3, rtol=1e-3)



def _masks(qo, kv, g):
    """Random per-request [qo_len, kv_len] masks (True = attend), one row fully masked."""
    masks = [torch.rand(a, b, generator=g) < 0.6 for a, b in zip(qo, kv)]
    first = next(m for m in masks if m.shape[0])
    first[0] = False  # a query that sees no key: out 0, LSE -inf
    return masks


@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
def test_custom_mask(packed, device):
    """FlashInfer's custom masks (each request's [qo_len, kv_len] booleans, flattened; True =
    attend, replacing causal) in the paged, ragged and single-request prefill calls."""
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    lens, indptr, indices, last, cache = _paged(3, 2, 64, 5, BF16, device, "NHD", 60, empty=False, g=g)
    qo = [min(n, q) for n, q in zip(lens, (7, 1, 20))]
    qo_indptr = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32)
    masks = _masks(qo, lens, g)
    flat = torch.cat([m.flatten() for m in masks])
    kw = dict(custom_mask=flat.to(device))
    if packed:
        seg = torch.tensor([0] + [m.numel() for m in masks], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kw = dict(packed_custom_mask=fi.segment_packbits(flat.to(device), seg)[0])
    q = torch.randn(sum(qo), 4, 64, device=device, dtype=BF16)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    w.plan(qo_indptr, indptr, indices.to(device), last, 4, 2, 64, 5, causal=True, q_data_type=BF16,
           **kw)
    out, lse = w.run(q, cache, return_lse=True)
    ks, vs = zip(*(_gather(cache, "NHD", indices, indptr, b, n) for b, n in enumerate(lens)))
    kv_indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    wr = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wr.plan(qo_indptr, kv_indptr, 4, 2, 64, causal=True, q_data_type=BF16, **kw)
    out_r = wr.run(q, torch.cat(ks), torch.cat(vs))
    for b in range(3):
        sl = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        lse_ref = _check_request(f"paged out[{b}]", out[sl], q[sl], ks[b], vs[b], attn_mask=masks[b])
        _check_request(f"ragged out[{b}]", out_r[sl], q[sl], ks[b], vs[b], attn_mask=masks[b])
        fin = torch.isfinite(lse_ref.t())
        assert torch.equal(torch.isfinite(lse[sl]), fin)
        torch.testing.assert_close(lse[sl][fin], (lse_ref.t() / math.log(2))[fin], atol=1e-3, rtol=1e-3)
    o1 = fi.single_prefill_with_kv_cache(q[:qo[0]], ks[0], vs[0], custom_mask=masks[0].to(device))
    _check_request("single out", o1, q[:qo[0]], ks[0], vs[0], attn_mask=masks[0])
    with pytest.raises(ValueError, match="custom_mask has"):
        w.plan(qo_indptr, indptr, indices.to(device), last, 4, 2, 64, 5, q_data_type=BF16,
               custom_mask=flat[1:].to(device))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_kv_cache(fp8, device):
    """An fp8 cache (kv_data_type) with k_scale / v_scale against attention over the dequantized
    cache: decode and paged prefill wrappers, single decode."""
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    h, h_k, d, page = 8, 2, 64, 4
    lens, indptr, indices, last, cache = _paged(3, h_k, d, page, BF16, device, max_len=50,
                                                empty=False, g=g)
    k_scale, v_scale = 0.5, 2.0
    cache8 = cache.to(fp8)  # quantized: real values = cache8 * scale
    deq = torch.stack([cache8[:, 0].to(BF16) * k_scale, cache8[:, 1].to(BF16) * v_scale], 1)
    ws = torch.empty(4 << 20, dtype=torch.uint8, device=device)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(indptr, indices.to(device), last, h, h_k, d, page, q_data_type=BF16, kv_data_type=fp8)
    q = torch.randn(3, h, d, device=device, dtype=BF16)
    out = w.run(q, cache8, k_scale=k_scale, v_scale=v_scale)
    qo = [min(n, 5) for n in lens]
    qo_indptr = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32)
    wp = fi.BatchPrefillWithPagedKVCacheWrapper(ws)
    wp.plan(qo_indptr, indptr, indices.to(device), last, h, h_k, d, page, causal=True,
            q_data_type=BF16, kv_data_type=fp8)
    qp = torch.randn(sum(qo), h, d, device=device, dtype=BF16)
    outp = wp.run(qp, cache8, k_scale=k_scale, v_scale=v_scale)
    for b, n in enumerate(lens):
        k, v = _gather(deq, "NHD", indices, indptr, b, n)
        _check_request(f"decode out[{b}]", out[b:b + 1], q[b:b + 1], k, v)
        sl = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        _check_request(f"prefill out[{b}]", outp[sl], qp[sl], k, v, causal=True)
    k8, v8 = _gather(cache8, "NHD", indices, indptr, 0, lens[0])
    o1 = fi.single_decode_with_kv_cache(q[0], k8, v8, k_scale=k_scale, v_scale=v_scale)
    k, v = _gather(deq, "NHD", indices, indptr, 0, lens[0])
    _check_request("single decode", o1[None], q[:1], k, v)
    with pytest.raises(ValueError, match="kv_data_type"):
        w.run(q, cache)  # planned for fp8, given bf16
    with pytest.raises(TypeError, match="kv_data_type"):
        w.plan(indptr, indices.to(device), last, h, h_k, d, page, q_data_type=BF16,
               kv_data_type=torch.float16)


def test_packbits_matches_numpy():
    import numpy as np

    x = torch.rand(37) < 0.5
    for order in ("little", "big"):
        want = np.packbits(x.numpy(), bitorder=order)
        assert torch.equal(fi.packbits(x, order), torch.from_numpy(want))
    packed, ip = fi.segment_packbits(x, torch.tensor([0, 9, 9, 37], dtype=torch.int32))
    assert ip.tolist() == [0, 2, 2, 6]
    assert torch.equal(packed[2:], fi.packbits(x[9:]))


def _rope_tables(n: int, d: int, scale: float, theta: float, device):
    i = torch.arange(d // 2, dtype=torch.float32, device=device)
    inv_freq = (1.0 / scale) * torch.exp2(-(2.0 * i / d) * math.log2(theta))
    ang = torch.arange(n, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("kind", ["decode", "prefill", "single_decode", "single_prefill", "ragged"])
def test_rope_llama(kind, device):
    """pos_encoding_mode='ROPE_LLAMA': q and k rotated inside attention (keys at 0..kv_len-1,
    queries at the last positions) against rotating first and attending."""
    g = torch.Generator().manual_seed(7)
    h, h_k, d, page, scale, theta = 4, 2, 64, 4, 2.0, 5e5
    lens, indptr, indices, last, cache = _paged(3, h_k, d, page, BF16, device, max_len=60,
                                                empty=False, g=g)
    cos, sin = _rope_tables(200, d, scale, theta, device)
    rope = dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=scale, rope_theta=theta)
    qo = [1, 1, 1] if "decode" in kind else [lens[0], min(3, lens[1]), 1]
    q = torch.randn(sum(qo), h, d, device=device, dtype=BF16)
    qo_indptr = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32)
    ws = torch.empty(4 << 20, dtype=torch.uint8, device=device)
    if kind == "decode":
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
        w.plan(indptr, indices.to(device), last, h, h_k, d, page, q_data_type=BF16, **rope)
        out = w.run(q, cache)
    elif kind == "prefill":
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws)
        w.plan(qo_indptr, indptr, indices.to(device), last, h, h_k, d, page, causal=True,
               q_data_type=BF16, **rope)
        out = w.run(q, cache)
    elif kind == "ragged":
        ks, vs = zip(*(_gather(cache, "NHD", indices, indptr, b, n) for b, n in enumerate(lens)))
        kv_indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws)
        w.plan(qo_indptr, kv_indptr, h, h_k, d, causal=True, q_data_type=BF16, **rope)
        out = w.run(q, torch.cat(ks), torch.cat(vs))
    for b, n in enumerate(lens):
        k, v = _gather(cache, "NHD", indices, indptr, b, n)
        qb = q[qo_indptr[b]:qo_indptr[b + 1]]
        if kind.startswith("single"):
            fn = fi.single_decode_with_kv_cache if kind == "single_decode" else fi.single_prefill_with_kv_cache
            got = fn(qb[0] if kind == "single_decode" else qb, k, v, **rope,
                     **({} if kind == "single_decode" else dict(causal=True)))
            got = got[None] if kind == "single_decode" else got
        else:
            got = out[qo_indptr[b]:qo_indptr[b + 1]]
        _check_rotated(f"{kind} out[{b}]", got, qb, k, v, cos, sin, causal=True)


def test_run_checks_buffers_and_caches(device):
    lens, indptr, indices, last, cache = _paged(2, 2, 64, 4, BF16, device, empty=False)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    w.plan(indptr, indices.to(device), last, 4, 2, 64, 4, q_data_type=BF16)
    q = torch.randn(2, 4, 64, device=device, dtype=BF16)
    with pytest.raises(ValueError, match="out must be"):
        w.run(q, cache, out=torch.empty(1, 4, 64, device=device, dtype=BF16))
    with pytest.raises(ValueError, match="out must be"):
        w.run(q, cache, out=torch.empty(2, 4, 128, device=device, dtype=BF16)[..., ::2])
    k, v = cache[:, 0], cache[:, 1]
    with pytest.raises(ValueError, match="v cache"):
        w.run(q, (k, v[:1]))
    with pytest.raises(ValueError, match="paged_kv_indptr"):
        fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=device)).plan(
            torch.tensor([0, 1, 2], dtype=torch.int32), indptr.flip(0), indices, last, 4, 2, 64, 4)

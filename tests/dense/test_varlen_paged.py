"""flash_attn_varlen_func with block_table (FlashAttention's paged varlen call, as vLLM makes it):
paged caches of any page size, ragged sequences with empty ones, GQA, masks, softcap and ALiBi,
checked against the reference on the same keys stored contiguously; q's gradient; the errors."""
from __future__ import annotations

import pytest
import torch

import ioattn
from ioattn.reference import attention_varlen_ref
from ioattn.testing import alibi_slopes, assert_close_rule, cu_seqlens, random_seqlens

BF16, FP16 = torch.bfloat16, torch.float16


def _paged(lk: list[int], page: int, h_k: int, d: int, dtype, device, spare: int = 2):
    """Contiguous packed K/V of lengths lk, and the same keys in a shuffled paged cache with a
    block table whose rows have `spare` unused pages past each sequence's (holding -1: rows
    may hold anything there)."""
    k = torch.randn(sum(lk), h_k, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    used = [-(-n // page) for n in lk]
    width = max(used) + spare
    n_pages = sum(used) + 3  # pages nobody uses too
    perm = torch.randperm(n_pages)[:sum(used)].tolist()
    k_cache = torch.randn(n_pages, page, h_k, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.full((len(lk), width), -1, dtype=torch.int32)
    start, nxt = 0, 0
    for i, n in enumerate(lk):
        for j in range(used[i]):
            p = perm[nxt]
            nxt += 1
            table[i, j] = p
            rows = slice(j * page, min(n, (j + 1) * page))
            cnt = rows.stop - rows.start
            k_cache[p, :cnt] = k[start + rows.start:start + rows.stop]
            v_cache[p, :cnt] = v[start + rows.start:start + rows.stop]
        start += n
    return k, v, k_cache, v_cache, table.to(device)


CASES = [  # (page, d, h, h_k, causal, window, softcap, alibi, dtype)
    (16, 64, 4, 2, True, (-1, -1), 0.0, False, BF16),
    (1, 64, 2, 2, False, (-1, -1), 0.0, False, FP16),
    (3, 96, 6, 2, True, (-1, -1), 0.0, False, BF16),
    (64, 128, 4, 1, False, (40, 10), 0.0, False, FP16),
    (16, 64, 4, 4, True, (-1, -1), 5.0, True, BF16),
]


@pytest.fixture(params=["copy", "pages"])
def path(request, monkeypatch):
    """The keys packed then the varlen kernels (the default), or attention over the pages (the
    path of calls too large to pack; ALiBi and q's gradient keep the copy)."""
    from ioattn.decode import op

    monkeypatch.setattr(op, "FORCE_PAGED_VARLEN", request.param == "pages")
    return request.param


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"page{c[0]}-d{c[1]}-h{c[2]}-{c[3]}"
                         f"{'-causal' if c[4] else ''}{'-window' if c[5][0] >= 0 else ''}"
                         f"{'-softcap' if c[6] else ''}{'-alibi' if c[7] else ''}")
def test_paged_varlen_matches_contiguous(case, path, device):
    page, d, h, h_k, causal, window, softcap, alibi, dtype = case
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    b = 4
    lk = random_seqlens(b, 150, g)
    lq = [min(n, m) for n, m in zip(random_seqlens(b, 90, g), lk)] if causal else \
        random_seqlens(b, 90, g)
    lq[0], lk[2] = 0, 0  # an empty query side and an empty key side
    if causal:
        lq[2] = 0  # (causal: at most as many queries as keys)
    k, v, k_cache, v_cache, table = _paged(lk, page, h_k, d, dtype, device)
    q = torch.randn(sum(lq), h, d, device=device, dtype=dtype)
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)
    slopes = alibi_slopes(None, h, device) if alibi else None
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    out, lse, _ = ioattn.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(lq), max(lk),
                                                return_attn_probs=True, block_table=table, **kw)
    ref, lse_ref = attention_varlen_ref(q, k, v, cq, ck, **kw)
    pt, _ = attention_varlen_ref(q, k, v, cq, ck, upcast=False, **kw)
    assert_close_rule("out", out, ref, pt)
    assert lse.shape == (h, q.shape[0])
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=1e-3, rtol=1e-3)
    # the reference backend's own gather gives the same
    want = ioattn.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(lq), max(lk),
                                         block_table=table, backend="reference", **kw)
    assert_close_rule("out (reference backend)", out, want.float(), pt)


def test_paged_varlen_q_gradient(path, device):
    """q's gradient through the paged call equals the contiguous call's, bitwise (the caches are
    constants of the call; deterministic: dQ without atomics)."""
    lk, lq = [70, 33, 0], [20, 33, 0]
    k, v, k_cache, v_cache, table = _paged(lk, 16, 2, 64, BF16, device)
    q = torch.randn(sum(lq), 4, 64, device=device, dtype=BF16, requires_grad=True)
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)
    out = ioattn.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, 33, 70, causal=True,
                                        deterministic=True, block_table=table)
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, dout)
    q2 = q.detach().requires_grad_()
    out2 = ioattn.flash_attn_varlen_func(q2, k, v, cq, ck, 33, 70, causal=True, deterministic=True)
    (dq2,) = torch.autograd.grad(out2, q2, dout)
    torch.testing.assert_close(out, out2, atol=0, rtol=0)
    torch.testing.assert_close(dq, dq2, atol=0, rtol=0)


def test_paged_varlen_errors(device):
    lk, lq = [40, 20], [10, 5]
    k, v, k_cache, v_cache, table = _paged(lk, 16, 2, 64, BF16, device, spare=0)
    q = torch.randn(sum(lq), 2, 64, device=device, dtype=BF16)
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)

    def call(**kw):
        args = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=10,
                    max_seqlen_k=40, block_table=table)
        args.update(kw)
        return ioattn.flash_attn_varlen_func(**args)

    with pytest.raises(ValueError, match="paged cache"):
        call(k=k)  # packed keys with a block table
    with pytest.raises(TypeError, match="int32"):
        call(block_table=table.long())
    with pytest.raises(ValueError, match=r"block_table must have shape \[batch=2"):
        call(block_table=table[:1])
    with pytest.raises(ValueError, match="holds 3 pages"):
        call(cu_seqlens_k=cu_seqlens([49, 20], device), max_seqlen_k=49)
    bad = table.clone()
    bad[1, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the caches"):
        call(block_table=bad)
    with pytest.raises(ValueError, match="get no gradients"):
        call(k=k_cache.clone().requires_grad_())
    with pytest.raises(ValueError, match="dropout_p must be 0"):
        call(dropout_p=0.1)
    with pytest.raises(ValueError, match="k's shape"):
        call(v=v_cache[:, :, :, :32])
    with pytest.raises(ValueError, match="page_size"):
        call(k=k_cache[:, :0], v=v_cache[:, :0])
    with pytest.raises(ValueError, match="cu_seqlens_q must be"):
        call(cu_seqlens_q=cq[:0])
    with pytest.raises(ValueError, match="pass the true max"):
        call(max_seqlen_k=30)


def test_paged_varlen_seqused_k(path, device):
    """FlashAttention-3's form of the paged call (vLLM's): cu_seqlens_k=None and seqused_k, each
    sequence's key count. The same result as cu_seqlens_k, bitwise; again after seqused_k is
    updated in place (a decode step's longer sequences: its prefix sum is made every call);
    eager and compiled fullgraph."""
    from tests.dense.test_op import BACKEND

    lk, lq = [61, 0, 35], [9, 0, 35]
    k, v, k_cache, v_cache, table = _paged(lk, 16, 2, 64, BF16, device, spare=1)
    q = torch.randn(sum(lq), 4, 64, device=device, dtype=BF16)
    cq = cu_seqlens(lq, device)
    used = torch.tensor(lk, dtype=torch.int32, device=device)

    def with_used(used_):
        return ioattn.flash_attn_varlen_func(q, k_cache, v_cache, cq, None, 35, 64, causal=True,
                                             block_table=table, seqused_k=used_)

    for lens in (lk, [64, 0, 40]):  # (within the pages their rows hold: 4 and 3 of 16)
        used.copy_(torch.tensor(lens, dtype=torch.int32))
        want = ioattn.flash_attn_varlen_func(q, k_cache, v_cache, cq, cu_seqlens(lens, device), 35,
                                             64, causal=True, block_table=table)
        for _ in range(2):  # (the second call: seqused_k's checks memoized)
            torch.testing.assert_close(with_used(used), want, atol=0, rtol=0)
    torch._dynamo.reset()
    got = torch.compile(with_used, fullgraph=True, backend=BACKEND)(used)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)


def test_paged_varlen_seqused_k_errors(device):
    lk, lq = [40, 20], [10, 5]
    _, _, k_cache, v_cache, table = _paged(lk, 16, 2, 64, BF16, device, spare=0)
    q = torch.randn(sum(lq), 2, 64, device=device, dtype=BF16)
    cq = cu_seqlens(lq, device)
    used = torch.tensor(lk, dtype=torch.int32, device=device)

    def call(**kw):
        args = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cq, cu_seqlens_k=None, max_seqlen_q=10,
                    max_seqlen_k=40, block_table=table, seqused_k=used)
        args.update(kw)
        return ioattn.flash_attn_varlen_func(**args)

    with pytest.raises(ValueError, match="seqused_k is supported with block_table"):
        call(block_table=None, k=k_cache.flatten(0, 1), v=v_cache.flatten(0, 1))
    with pytest.raises(ValueError, match="not both"):
        call(cu_seqlens_k=cu_seqlens(lk, device))
    with pytest.raises(TypeError, match="seqused_k must be int32"):
        call(seqused_k=used.long())
    with pytest.raises(TypeError, match="seqused_k must be a torch.Tensor"):
        call(seqused_k=lk)
    with pytest.raises(ValueError, match=r"seqused_k must have shape \(batch,\) = \(2,\)"):
        call(seqused_k=used[:1])
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = -1"):
        call(seqused_k=torch.tensor([40, -1], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 41 must be in \[0, max_seqlen_k=40\]"):
        call(seqused_k=torch.tensor([41, 1], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="holds 3 pages"):  # (a row of 3 pages of 16: 48 keys)
        call(seqused_k=torch.tensor([49, 1], dtype=torch.int32, device=device), max_seqlen_k=49)
    with pytest.raises(TypeError, match="or seqused_k"):
        call(seqused_k=None)  # neither
    with pytest.raises(ValueError, match="cu_seqlens_q must be"):
        call(cu_seqlens_q=cq[:0])


def test_paged_varlen_strided_table_and_narrow_packing(device):
    """A block table that is a strided view reads its logical entries (the gather reads rows
    with unit stride: it gets a contiguous copy), and the packed K/V take max_seqlen_k rows per
    sequence, not a full-width row's (engines pass tables sized for the longest context)."""
    from ioattn.decode.op import gather_pages

    lk, lq = [40, 7, 0], [5, 7, 0]
    k, v, k_cache, v_cache, table = _paged(lk, 4, 2, 64, FP16, device, spare=30)
    wide = torch.full((3, 2 * table.shape[1]), -7, dtype=torch.int32, device=device)
    wide[:, ::2] = table
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)
    q = torch.randn(sum(lq), 4, 64, device=device, dtype=FP16)
    got = ioattn.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, 7, 40, block_table=wide[:, ::2])
    want = ioattn.flash_attn_varlen_func(q, k, v, cq, ck, 7, 40)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    k_packed, _ = gather_pages(k_cache, v_cache, ck, table, 40)
    assert k_packed.shape[0] == 3 * 40  # not 3 x (table width x page size)


def test_paged_varlen_compiles_fullgraph(path, device):
    """The paged call traces without a graph break (the gather is a torch.library op with a
    fake) and gives the eager result."""
    from tests.dense.test_op import BACKEND

    torch._dynamo.reset()
    lk, lq = [50, 17], [9, 17]
    k, v, k_cache, v_cache, table = _paged(lk, 16, 2, 64, BF16, device)
    q = torch.randn(sum(lq), 4, 64, device=device, dtype=BF16)
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)

    def f(q, k_cache, v_cache):
        return ioattn.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, 17, 50, causal=True,
                                             block_table=table)

    got = torch.compile(f, fullgraph=True, backend=BACKEND)(q, k_cache, v_cache)
    torch.testing.assert_close(got, f(q, k_cache, v_cache), atol=2e-2, rtol=0)


def test_paged_ops_opcheck(device):
    from ioattn.decode.op import gather_pages_op, paged_varlen_attn_op

    _, _, k_cache, v_cache, table = _paged([30, 0, 17], 8, 2, 64, BF16, device)
    ck = cu_seqlens([30, 0, 17], device)
    torch.library.opcheck(gather_pages_op, (k_cache, v_cache, ck, table, 30))
    q = torch.randn(12, 4, 64, device=device, dtype=BF16)
    torch.library.opcheck(paged_varlen_attn_op, (q, k_cache, v_cache, cu_seqlens([5, 0, 7], device),
                                                 ck, table, 7, 0.125, -1, 0, 0.0))


def test_paged_varlen_odd_inputs(path, device):
    """A q whose last dim is strided, a zero-width block table, and backend names the pages'
    path does not serve (unknown: refused by name; 'sm90' off Hopper: refused with the reason)."""
    lk, lq = [30, 9], [4, 9]
    k, v, k_cache, v_cache, table = _paged(lk, 8, 2, 64, FP16, device)
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)
    q_t = torch.randn(4, 64, sum(lq), device=device, dtype=FP16).permute(2, 0, 1)
    got = ioattn.flash_attn_varlen_func(q_t, k_cache, v_cache, cq, ck, 9, 30, causal=True,
                                        block_table=table)
    want = ioattn.flash_attn_varlen_func(q_t.contiguous(), k, v, cq, ck, 9, 30, causal=True)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    empty = ioattn.flash_attn_varlen_func(q_t, k_cache, v_cache, cq, cu_seqlens([0, 0], device),
                                          9, 0, block_table=table[:, :0])
    assert empty.shape == q_t.shape and not empty.isnan().any()
    with pytest.raises(ValueError, match="backend"):
        ioattn.flash_attn_varlen_func(q_t, k_cache, v_cache, cq, ck, 9, 30, block_table=table,
                                      backend="bogus")


def test_paged_varlen_path_rule(monkeypatch):
    """Calls whose packed K + V stay within PAGED_VARLEN_MAX_BYTES are packed; larger ones
    attend over the pages."""
    from ioattn.decode import op

    monkeypatch.setattr(op, "FORCE_PAGED_VARLEN", None)
    k = torch.empty(4, 16, 8, 128, dtype=BF16)
    rows = op.PAGED_VARLEN_MAX_BYTES // (2 * 8 * 128 * 2)
    assert op.paged_varlen_copies(k, 1, rows) and not op.paged_varlen_copies(k, 1, rows + 1)

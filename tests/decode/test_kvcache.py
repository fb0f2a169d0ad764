"""flash_attn_with_kvcache against a per-sequence reference (pages gathered into contiguous K/V),
FlashAttention's tolerance rule; the caches' new contents are checked too."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import ioattn
from ioattn.reference import kvcache_attention_ref
from ioattn.testing import alibi_slopes, assert_close_rule
from tests.conftest import ON_GPU

BF16, FP16 = torch.bfloat16, torch.float16


@dataclass(frozen=True)
class KVCase:
    b: int = 3
    s_q: int = 1
    h: int = 4
    h_k: int = 1
    d: int = 64
    page: Optional[int] = 16  # None: contiguous cache
    s_new: int = 0
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool | str = False  # True: slopes (h,); "batch": (b, h)
    rotary: Optional[str] = None  # None | "interleaved" | "halves"
    leftpad: bool = False
    batch_idx: bool = False
    empty_seq: bool = False  # the last sequence starts empty (cache_seqlens 0): no key at all
    #                          unless new tokens are appended
    splits: int = 0
    dtype: torch.dtype = BF16
    capacity: int = 150

    @property
    def id(self) -> str:
        parts = [f"B{self.b}-Q{self.s_q}-H{self.h}/{self.h_k}-D{self.d}",
                 f"page{self.page}" if self.page else "contig", f"new{self.s_new}",
                 "bf16" if self.dtype == BF16 else "fp16"]
        for flag, name in ((self.causal, "causal"), (self.softcap, f"cap{self.softcap}"),
                           (self.alibi, "alibi-batch" if self.alibi == "batch" else "alibi"),
                           (self.rotary, f"rope-{self.rotary}"), (self.leftpad, "leftpad"),
                           (self.batch_idx, "batchidx"), (self.empty_seq, "emptyseq")):
            if flag:
                parts.append(name)
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        parts.append(f"splits{self.splits}")
        return "-".join(parts)


CASES = [
    KVCase(),  # decode, GQA 4, paged 16
    KVCase(page=1, h=5, h_k=1, splits=3),
    KVCase(page=3, h=2, h_k=2, s_q=3, causal=True, s_new=3, rotary="interleaved", splits=2),
    KVCase(page=None, h=6, h_k=2, s_new=2, rotary="halves", causal=True, splits=1, dtype=FP16),
    KVCase(page=None, batch_idx=True, h=8, h_k=1, s_q=2, window=(40, 0), splits=4),
    KVCase(page=16, h=4, h_k=2, s_q=4, causal=True, softcap=3.0, alibi=True, leftpad=True,
           s_new=4, rotary="interleaved"),
    KVCase(page=7, h=7, h_k=1, d=96, s_q=1, splits=0, dtype=FP16),
    KVCase(page=None, leftpad=True, h=4, h_k=4, s_q=5, window=(30, -1), s_new=1, splits=2),
]
if ON_GPU:
    CASES += [
        KVCase(b=8, h=32, h_k=8, d=128, page=16, capacity=4096, splits=0),
        KVCase(b=2, h=32, h_k=8, d=128, page=1, capacity=2048, s_q=4, causal=True, s_new=4,
               rotary="halves"),
        KVCase(b=3, h=16, h_k=16, d=256, page=64, capacity=1024, s_q=2, causal=True),
        KVCase(b=2, h=64, h_k=2, d=128, page=None, capacity=3000, s_q=16, causal=True, s_new=16),
    ]


def _build(c: KVCase, device):
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    cap = c.capacity
    lens = torch.randint(1, cap - c.s_new + 1, (c.b,), generator=g)
    lens[0] = cap - c.s_new  # one sequence at full capacity
    if c.empty_seq:
        lens[-1] = 0
    pads = torch.randint(0, 20, (c.b,), generator=g).minimum(lens) if c.leftpad else None
    if c.page:
        pages_per_seq = -(-cap // c.page)
        n_pages = c.b * pages_per_seq + 5
        perm = torch.randperm(n_pages, generator=g)[:c.b * pages_per_seq]  # scattered pages
        block_table = perm.view(c.b, pages_per_seq).to(torch.int32).to(device)
        shape = (n_pages, c.page, c.h_k, c.d)
        batch_idx = None
    else:
        block_table = None
        rows = c.b + 2 if c.batch_idx else c.b
        shape = (rows, cap, c.h_k, c.d)
        batch_idx = (torch.randperm(rows, generator=g)[:c.b].to(torch.int32).to(device)
                     if c.batch_idx else None)
    k_cache = torch.randn(shape, device=device, dtype=c.dtype)
    v_cache = torch.randn(shape, device=device, dtype=c.dtype)
    q = torch.randn(c.b, c.s_q, c.h, c.d, device=device, dtype=c.dtype)
    k = v = None
    if c.s_new:
        k = torch.randn(c.b, c.s_new, c.h_k, c.d, device=device, dtype=c.dtype)
        v = torch.randn(c.b, c.s_new, c.h_k, c.d, device=device, dtype=c.dtype)
    cos = sin = None
    if c.rotary:
        rd = c.d // 2 if c.d % 4 == 0 else c.d - 2  # a partial rotary dim
        rows = (-(-cap // c.page) * c.page if c.page else cap) + 8  # the cache's full extent
        ang = torch.rand(rows, rd // 2, device=device) * 6.28
        cos, sin = ang.cos().to(c.dtype), ang.sin().to(c.dtype)
    kw = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin,
              cache_seqlens=lens.to(torch.int32).to(device), cache_batch_idx=batch_idx,
              cache_leftpad=pads.to(torch.int32).to(device) if pads is not None else None,
              block_table=block_table)
    opts = dict(causal=c.causal, window_size=c.window, softcap=c.softcap,
                rotary_interleaved=c.rotary == "interleaved",
                alibi_slopes=(alibi_slopes(c.b if c.alibi == "batch" else None, c.h, device)
                              if c.alibi else None))
    return q, k_cache, v_cache, kw, opts


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_kvcache(c: KVCase, device):
    check_against_ref(c, device)


def check_against_ref(c: KVCase, device) -> None:
    """flash_attn_with_kvcache on a fresh random case against ``kvcache_attention_ref``: out by
    the tolerance rule, the LSE and the caches' new contents."""
    q, k_cache, v_cache, kw, opts = _build(c, device)
    ref, lse_ref, kc_ref, vc_ref = kvcache_attention_ref(q, k_cache, v_cache, **kw, **opts)
    pt, _, _, _ = kvcache_attention_ref(q, k_cache, v_cache, **kw, **opts, upcast=False)
    out, lse = ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts,
                                              num_splits=c.splits, return_softmax_lse=True)
    assert_close_rule("out", out, ref, pt)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "LSE -inf pattern differs"
    # rotary rounds q and k once more, and FMA contraction may move that rounding by one ulp of
    # the input dtype, which moves scores (and the LSE) by about that relative amount
    tol = torch.finfo(c.dtype).eps if c.rotary else 1e-3
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=tol, rtol=tol)
    if c.s_new:  # the new tokens landed where the reference put them, rotated the same way
        # (rotation in fp32 either way; FMA contraction may move the rounding by one ulp)
        eps = torch.finfo(c.dtype).eps
        torch.testing.assert_close(k_cache.float(), kc_ref.float(), atol=eps, rtol=2 * eps)
        torch.testing.assert_close(v_cache, vc_ref, atol=0, rtol=0)


@pytest.mark.parametrize("capacity, splits", [(180, (2, 3)), (1500, (17, 24))],
                         ids=["few", "more-than-one-merge-step"])
def test_splits_agree(capacity, splits, device):
    """Split-KV with any split count merges to the unsplit result (up to fp32 rounding); over 16
    splits the combine kernel merges in several steps."""
    c = KVCase(b=2, h=8, h_k=2, page=5, capacity=capacity)
    q, k_cache, v_cache, kw, opts = _build(c, device)
    outs = [ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts, num_splits=n)
            for n in (1,) + splits]
    for o in outs[1:]:
        torch.testing.assert_close(o.float(), outs[0].float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("bad, match", [
    (dict(cache_seqlens="too_long"), "capacity"),
    (dict(block_table="out_of_range"), "block_table entries"),
    (dict(block_table="int64"), "int32"),
    (dict(k_only=True), "both k and v"),
    (dict(rotary_short=True), "positions"),
    (dict(q_fp32=True), "float16"),
])
def test_kvcache_errors(bad, match, device):
    c = KVCase(b=2, s_new=1, rotary="halves")
    q, k_cache, v_cache, kw, opts = _build(c, device)
    if bad.get("cache_seqlens") == "too_long":
        full = kw["block_table"].shape[1] * c.page
        kw["cache_seqlens"] = torch.full((2,), full, dtype=torch.int32, device=device)
    if bad.get("block_table") == "out_of_range":
        kw["block_table"] = kw["block_table"].clone()
        kw["block_table"][1, 0] = k_cache.shape[0]
    if bad.get("block_table") == "int64":
        kw["block_table"] = kw["block_table"].long()
    if bad.get("k_only"):
        kw["v"] = None
    if bad.get("rotary_short"):
        kw["rotary_cos"], kw["rotary_sin"] = kw["rotary_cos"][:10], kw["rotary_sin"][:10]
    if bad.get("q_fp32"):
        q = q.float()
    with pytest.raises((ValueError, TypeError), match=match):
        ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts)


def test_kvcache_values_rechecked_after_in_place_updates(device):
    """Index values are checked once per state of the index tensors: a second call with the same
    tensors skips the host sync, an in-place update (a new decode step) is checked again."""
    from ioattn.decode import api

    c = KVCase(b=2)
    q, k_cache, v_cache, kw, opts = _build(c, device)
    lens = kw["cache_seqlens"]
    ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts)
    assert api.VALIDATED.entries[0][0][0]() is lens  # checked once, remembered
    lens.fill_(kw["block_table"].shape[1] * c.page + 1)  # past the capacity
    with pytest.raises(ValueError, match="capacity"):
        ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts)


def test_kvcache_op_and_compile(device):
    """The op passes opcheck (schema, fake, mutation of the caches) and compiles without a graph
    break (aot_eager on CPU, inductor on GPU)."""
    from ioattn.decode.op import kvcache_fwd

    c = KVCase(b=2, s_q=2, h=4, h_k=2, page=3, s_new=2, causal=True, rotary="halves", capacity=40)
    q, k_cache, v_cache, kw, opts = _build(c, device)
    args = (q, k_cache, v_cache, kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"],
            kw["cache_seqlens"], None, None, kw["block_table"], None, 0.125, -1, 0, 0.0, False, 2)
    torch.library.opcheck(kvcache_fwd, args)

    def step(q, k_cache, v_cache, k, v, cos, sin, lens, table):
        return ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, lens,
                                              block_table=table, causal=True)

    fn = torch.compile(step, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    k2, v2 = k_cache.clone(), v_cache.clone()
    got = fn(q, k2, v2, kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"], kw["cache_seqlens"],
             kw["block_table"])
    want = step(q, k_cache, v_cache, kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"],
                kw["cache_seqlens"], kw["block_table"])
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(k2, k_cache, atol=0, rtol=0)


def test_strided_indices_and_empty_caches(device):
    """Index vectors, slopes and table rows given as strided views read the same as contiguous
    copies; a cache with no capacity gives out 0 and LSE -inf; batch 0 returns empty."""
    c = KVCase(b=3, h=4, h_k=2, page=4, alibi=True, leftpad=True, s_q=2, causal=True)
    q, k_cache, v_cache, kw, opts = _build(c, device)
    want = ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts)
    strided = dict(kw)
    for key in ("cache_seqlens", "cache_leftpad"):
        strided[key] = torch.stack([kw[key], kw[key]], 1)[:, 0]
    bt = kw["block_table"]
    strided["block_table"] = torch.stack([bt, bt], 2).flatten(1)[:, ::2]
    sopts = dict(opts, alibi_slopes=torch.stack([opts["alibi_slopes"]] * 2, 1)[:, 0])
    assert strided["block_table"].stride(1) == 2 and sopts["alibi_slopes"].stride(0) == 2
    got = ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **strided, **sopts)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    empty = torch.zeros(2, 0, 2, 64, device=device, dtype=BF16)
    out, lse = ioattn.flash_attn_with_kvcache(q[:2], empty, empty, cache_seqlens=0,
                                              return_softmax_lse=True)
    assert (out == 0).all() and torch.isinf(lse).all() and (lse < 0).all()
    assert ioattn.flash_attn_with_kvcache(q[:0], k_cache, v_cache, cache_seqlens=kw["cache_seqlens"][:0],
                                          block_table=bt[:0]).shape[0] == 0


# fp8 caches: FlashAttention-3's form ("fa3": q, caches and new k / v e4m3 with fp32 descales
# per sequence and KV head; "fa3-qheads": q's descale per query head) and a 16-bit q over an fp8
# cache (FlashInfer's kv_data_type; "e5m2" with k / v descales, "e4m3" without)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_CASES = [
    ("fa3", KVCase()),  # decode, GQA 4, paged 16
    ("fa3-qheads", KVCase(page=None, h=6, h_k=2, s_q=2, s_new=2, causal=True, splits=2)),
    ("fa3", KVCase(page=3, h=2, h_k=2, s_q=3, causal=True, rotary="interleaved", splits=3)),
    ("fa3", KVCase(page=5, h=4, h_k=1, s_q=2, causal=True, s_new=2, rotary="halves",
                   empty_seq=True)),  # rotated fp8 keys appended, one sequence only new ones
    ("e5m2", KVCase(page=1, h=5, h_k=1, splits=3, dtype=FP16)),
    ("fa3-nodescale", KVCase(page=None, h=4, h_k=2, s_q=2, causal=True, splits=2)),
    # descales as amax / 448 gives them (1e-3..1e-2), their (batch, heads, 1) form
    ("fa3-small", KVCase(page=16, h=8, h_k=2, s_q=1, s_new=1, d=128)),
    ("e4m3", KVCase(page=16, h=4, h_k=2, s_q=2, softcap=3.0, window=(40, 0), d=96)),
]
if ON_GPU:
    FP8_CASES += [
        ("fa3", KVCase(b=8, h=32, h_k=8, d=128, page=16, capacity=4096)),
        # chunked prefill onto the cache (the gathered path: keys converted into packed K / V)
        ("fa3", KVCase(b=2, h=32, h_k=8, d=128, page=16, capacity=2560, s_q=512, s_new=512,
                       causal=True)),
    ]


def _fp8_build(form: str, c: KVCase, device):
    """A fresh case in fp8 and its descales (fp32, in [0.5, 1.5))."""
    q, k_cache, v_cache, kw, opts = _build(c, device)
    cache = E5M2 if form == "e5m2" else E4M3
    k_cache, v_cache = k_cache.to(cache), v_cache.to(cache)
    if kw["k"] is not None:
        kw["k"], kw["v"] = kw["k"].to(cache), kw["v"].to(cache)
    h_k = c.h if form == "fa3-qheads" else c.h_k

    def descale(heads):
        if form == "fa3-small":
            return (torch.rand(c.b, heads, 1, device=device) * 9 + 1) * 1e-3
        return torch.rand(c.b, heads, device=device) + 0.5

    ds = {}
    if form.startswith("fa3"):
        q = q.to(E4M3)
    if form.startswith("fa3") and form != "fa3-nodescale":
        ds["q_descale"] = descale(h_k)
    if form not in ("e4m3", "fa3-nodescale"):
        ds["k_descale"] = descale(c.h_k)
        ds["v_descale"] = descale(c.h_k)
    return q, k_cache, v_cache, kw, opts, ds


@pytest.mark.parametrize("form, c", FP8_CASES, ids=[f"{f}-{c.id}" for f, c in FP8_CASES])
def test_kvcache_fp8(form, c: KVCase, device):
    """fp8 caches against the reference on the dequantized values: q times its and k's
    descales in fp32 over the fp8 keys, times v's descale after; the baseline does the same in
    16 bits (q's dtype, bf16 for an fp8 q) over the same keys (new ones rounded to fp8 as the
    cache holds them). The caches' new contents match the reference's."""
    q, k_cache, v_cache, kw, opts, ds = _fp8_build(form, c, device)
    group = c.h // c.h_k
    per_head = {n: t.reshape(c.b, -1).repeat_interleave(c.h // t.shape[1], 1)[:, None, :, None]
                for n, t in ds.items()}
    one = torch.ones((), device=device)
    q_ref = q.float() * per_head.get("q_descale", one) * per_head.get("k_descale", one)
    vd = per_head.get("v_descale", one)
    ref, lse_ref, kc_ref, vc_ref = kvcache_attention_ref(q_ref, k_cache, v_cache, **kw, **opts)
    low = BF16 if q.dtype == E4M3 else q.dtype
    pt, lse_pt, _, _ = kvcache_attention_ref(q_ref.to(low), k_cache.to(low), v_cache.to(low),
                                             **kw, **opts, upcast=False)
    out, lse = ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts, **ds,
                                              num_splits=c.splits, return_softmax_lse=True)
    assert out.dtype == low and group * c.h_k == c.h
    assert_close_rule("out", out, ref * vd, (pt.float() * vd).to(low))
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "LSE -inf pattern differs"
    base = (lse_pt[finite] - lse_ref[finite]).abs().max().item() if finite.any() else 0.0
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=2 * base + 1e-3, rtol=0)
    if c.s_new:  # rotated keys rounded to fp8 as the reference rounds them (fp32 rotation)
        torch.testing.assert_close(k_cache.float(), kc_ref.float(), atol=0,
                                   rtol=0 if not c.rotary else 0.125)
        assert torch.equal(v_cache.view(torch.uint8), vc_ref.view(torch.uint8))


@pytest.mark.parametrize("bad, match", [
    ("q_descale_16bit_q", "q_descale applies to fp8 q"),
    ("k_descale_16bit_cache", "k_descale applies to fp8 caches"),
    ("block_descale", "block descales"),
    ("fp16_descale", "float32"),
    ("fp8_q_16bit_cache", "caches must share"),
    ("e5m2_under_fp8_q", "caches must share"),
    ("new_k_16bit", "the cache's dtype"),
])
def test_kvcache_fp8_errors(bad, match, device):
    c = KVCase(b=2, s_new=1)
    q, k_cache, v_cache, kw, opts, ds = _fp8_build("fa3", c, device)
    if bad == "q_descale_16bit_q":
        q = q.to(BF16)
    if bad in ("k_descale_16bit_cache", "fp8_q_16bit_cache"):
        k_cache, v_cache = k_cache.to(BF16), v_cache.to(BF16)
        kw["k"], kw["v"] = kw["k"].to(BF16), kw["v"].to(BF16)
        if bad == "k_descale_16bit_cache":
            q = q.to(BF16)
            del ds["q_descale"]
    if bad == "block_descale":
        ds["k_descale"] = ds["k_descale"][:, :, None].expand(-1, -1, 2).contiguous()
    if bad == "fp16_descale":
        ds["v_descale"] = ds["v_descale"].half()
    if bad == "e5m2_under_fp8_q":
        k_cache, v_cache = k_cache.to(E5M2), v_cache.to(E5M2)
    if bad == "new_k_16bit":
        kw["k"], kw["v"] = kw["k"].to(BF16), kw["v"].to(BF16)
    with pytest.raises((ValueError, TypeError), match=match):
        ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts, **ds)

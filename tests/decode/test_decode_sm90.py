"""The sm90 paged decode kernel (``ioattn.decode.sm90_decode``, on by default on Hopper)
behind ``BatchDecodeWithPagedKVCacheWrapper``: its coverage rules and cache row views (anywhere),
and on Hopper its outputs against per-request references, split requests, empty requests, NaN in
stale cache slots and CUDA-graph replay; fp8 caches on it (on by default; IOATTN_SM90_DECODE_FP8=0 turns them off).
Softcap runs on it too; windows, RoPE and custom masks stay on the portable kernel."""
from __future__ import annotations

import math

import pytest
import torch

import ioattn.flashinfer as fi
from ioattn.decode import sm90_decode, triton_decode
from ioattn.dispatch import sm90_unavailable_reason
from tests.paged.test_flashinfer import _check_request, _gather, _paged, replay_long_and_check

BF16, FP16 = torch.bfloat16, torch.float16
SM90 = torch.cuda.is_available() and sm90_unavailable_reason(torch.device("cuda")) is None
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (H100/H200) with Triton 3.6.x")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sm90_decode_on(monkeypatch, merge=False, balanced=False):
    """The planned decode forced onto the sm90 kernel (merge: split requests
    merged inside it; balanced: FlashInfer's balanced split, each CTA looping over its column's
    items); returns the list each of its launches appends to."""
    monkeypatch.setattr(triton_decode, "SM90_DECODE", True)
    monkeypatch.setattr(triton_decode, "SM90_DECODE_MERGE", merge)
    monkeypatch.setattr(triton_decode, "SM90_DECODE_BALANCED", balanced)
    if balanced:  # (few SMs: the columns hold several items, requests cut many times)
        monkeypatch.setattr(fi, "sm_count", lambda device: 4)
    calls = []  # per launch: whether it ran the balanced form (the columns, argument 15)
    orig = sm90_decode.paged_decode_sm90
    monkeypatch.setattr(sm90_decode, "paged_decode_sm90",
                        lambda *a, **kw: calls.append(a[15] is not None) or orig(*a, **kw))
    return calls


def _views(layout="NHD", pages=6, page=16, h_k=2, d=128, dtype=BF16, pools=False):
    if pools:
        shape = (pages, page, h_k, d) if layout == "NHD" else (pages, h_k, page, d)
        k, v = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    else:
        shape = (pages, 2, page, h_k, d) if layout == "NHD" else (pages, 2, h_k, page, d)
        cache = torch.randn(shape, dtype=dtype)
        k, v = cache[:, 0], cache[:, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def test_row_views_of_cache_layouts():
    """Key slots as 2-D rows: NHD rows hold every head (the head is a column offset), HND rows
    one head (the head is a row offset); pages are page_rows apart."""
    k, _ = _views("NHD")
    assert sm90_decode._row_view(k) == (32, 0, 128, 256, 256)
    k, _ = _views("HND")
    assert sm90_decode._row_view(k) == (64, 16, 0, 128, 128)
    k, _ = _views("NHD", pools=True)
    assert sm90_decode._row_view(k) == (16, 0, 128, 256, 256)
    k, _ = _views("HND", pools=True)
    assert sm90_decode._row_view(k) == (32, 16, 0, 128, 128)
    assert sm90_decode._row_view(k[..., ::2]) is None  # strided head dim


@pytest.mark.parametrize("kw, match", [
    (dict(), None), (dict(layout="HND"), None), (dict(pools=True), None), (dict(page=128), None),
    (dict(page=8, d=64, dtype=FP16), None),
    (dict(page=3), "page_size 3"), (dict(page=24), "page_size 24"), (dict(d=96), "head_dim 96"),
    (dict(fp8=True), "fp8"), (dict(group=65), "GQA group"), (dict(extras=True), "RoPE"),
    (dict(rows=2), "one query row")])
def test_coverage_rules(kw, match, monkeypatch):
    monkeypatch.setattr(sm90_decode, "FP8", False)
    kw = dict(kw)
    fp8, group, extras, rows = (kw.pop(n, dflt) for n, dflt in
                                (("fp8", False), ("group", 4), ("extras", False), ("rows", 1)))
    k, v = _views(**kw)
    q = torch.randn(3, group * k.shape[2], k.shape[-1], dtype=k.dtype)
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    problem = sm90_decode.coverage_problem(q, k, v, rows, extras)
    if match is None:
        assert problem is None
    else:
        assert problem is not None and match in problem, problem


def test_d256_coverage(monkeypatch):
    """Head dim 256 is covered only with IOATTN_SM90_DECODE_D256 on (the default;
    ``SUPPORTED_HEAD_DIMS``), and compiles for ``MAXNREG_D256`` registers a thread; the others
    for ``MAXNREG``."""
    k, v = _views(d=256)
    q = torch.randn(3, 4 * k.shape[2], 256, dtype=k.dtype)
    monkeypatch.setattr(sm90_decode, "SUPPORTED_HEAD_DIMS", (64, 128))
    assert "head_dim 256" in sm90_decode.coverage_problem(q, k, v, 1, False)
    monkeypatch.setattr(sm90_decode, "SUPPORTED_HEAD_DIMS", (64, 128, 256))
    assert sm90_decode.coverage_problem(q, k, v, 1, False) is None
    assert sm90_decode.launch_maxnreg(256) == sm90_decode.MAXNREG_D256 > sm90_decode.MAXNREG
    assert sm90_decode.launch_maxnreg(128) == sm90_decode.launch_maxnreg(64) == sm90_decode.MAXNREG
    monkeypatch.setattr(sm90_decode, "MMA16", True)  # (the mma.sync consumer: d <= 128 only)
    assert not sm90_decode.launch_constexprs(256, 16, 4, False, True)["MMA16_"]
    assert sm90_decode.launch_constexprs(128, 16, 4, False, True)["MMA16_"]


def test_fp8_coverage(monkeypatch):
    """fp8 caches (e4m3 / e5m2) with fp16 / bf16 queries are covered while IOATTN_SM90_DECODE_FP8
    is on; an fp8 q or mixed k / v dtypes still are not."""
    monkeypatch.setattr(sm90_decode, "FP8", True)
    for dtype in (BF16, FP16):
        k, v = _views(dtype=dtype)
        q = torch.randn(3, 4 * k.shape[2], k.shape[-1], dtype=dtype)
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            assert sm90_decode.coverage_problem(q, k.to(fp8), v.to(fp8), 1, False) is None
        assert sm90_decode.coverage_problem(q, k.to(torch.float8_e4m3fn),
                                            v.to(torch.float8_e5m2), 1, False) is not None
        assert sm90_decode.coverage_problem(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn),
                                            v.to(torch.float8_e4m3fn), 1, False) is not None


def test_prefetch_rule():
    """L2 prefetches before the wait (IOATTN_SM90_DECODE_PREFETCH) only with PDL (without it
    there is nothing to wait for) and one item a CTA (not the balanced form)."""
    def rule(**kw):
        return sm90_decode.launch_constexprs(128, 16, 4, False, True, **kw)["PREFETCH_"]

    assert rule(pdl=True, prefetch=True)
    assert not rule(pdl=False, prefetch=True)
    assert not rule(pdl=True, prefetch=True, balanced=True)
    assert not rule(pdl=True, prefetch=False)


def test_mma16_rule(monkeypatch):
    """The mma.sync consumer (IOATTN_SM90_DECODE_MMA16) takes GQA groups of at most 16 heads
    (its rows); larger groups keep the 64-row wgmma tile."""
    monkeypatch.setattr(sm90_decode, "MMA16", True)
    for group, want in ((1, True), (4, True), (16, True), (17, False), (64, False)):
        assert sm90_decode.launch_constexprs(128, 16, group, False, True)["MMA16_"] == want
    monkeypatch.setattr(sm90_decode, "MMA16", False)
    assert not sm90_decode.launch_constexprs(128, 16, 4, False, True)["MMA16_"]


def test_eager_plans_ask_the_sm90_rule(monkeypatch):
    """Every planned decode run(), eager or graph-mode and whatever its size, asks the sm90 rule
    (``triton_decode._sm90_decode``) and takes the portable kernel only where it says no: eager
    plans under 200 MiB of K+V kept the portable kernel until the sm90 launch's host time fell
    (its launches kept for repeats, ``sm90_decode._BOUND``). On a CPU the portable kernel then
    runs under the interpreter."""
    import ioattn.flashinfer as fi

    asked = []
    monkeypatch.setattr(triton_decode, "_sm90_decode", lambda *a: asked.append(1) and False)
    for graph in (False, True):
        asked.clear()
        kw = dict(use_cuda_graph=True, paged_kv_indices_buffer=torch.empty(
            4, dtype=torch.int32, device=DEVICE)) if graph else {}
        q = torch.randn(1, 4, 64, dtype=BF16, device=DEVICE)
        cache = torch.randn(4, 2, 16, 1, 64, dtype=BF16, device=DEVICE)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(8 << 20, dtype=torch.uint8, device=DEVICE), **kw)
        w.plan(torch.tensor([0, 4], dtype=torch.int32, device=DEVICE),
               torch.arange(4, dtype=torch.int32, device=DEVICE),
               torch.tensor([16], dtype=torch.int32, device=DEVICE), 4, 1, 64, 16, q_data_type=BF16)
        w.run(q, cache)
        assert asked == [1], (graph, asked)


CASES = [
    dict(batch=4, h=8, h_k=2, d=64, page=16, layout="NHD"),
    dict(batch=3, h=32, h_k=8, d=128, page=16, layout="NHD", split=64, max_len=900),
    dict(batch=5, h=4, h_k=4, d=128, page=8, layout="HND", dtype=FP16),
    dict(batch=2, h=16, h_k=1, d=64, page=64, layout="HND", max_len=700),
    dict(batch=3, h=32, h_k=8, d=128, page=128, layout="NHD", max_len=1000),
    dict(batch=64, h=32, h_k=8, d=128, page=16, layout="NHD", max_len=4096),
    dict(batch=1, h=32, h_k=8, d=128, page=16, layout="NHD", max_len=32768),
    # splits of 40 keys: items that start mid-tile (keys before theirs masked)
    dict(batch=3, h=8, h_k=2, d=128, page=8, layout="NHD", split=40, max_len=300),
]


def _stale_paged(c, dtype):
    """A random paged cache for case c whose stale slots (past each request's last key, in its
    last page) hold NaN."""
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    lens, indptr, indices, last, cache = _paged(c["batch"], c["h_k"], c["d"], c["page"], dtype,
                                                "cuda", c["layout"], c.get("max_len", 120), g=g)
    for b, n in enumerate(lens):
        if n % c["page"]:
            p = indices[indptr[b + 1] - 1].item()
            if c["layout"] == "NHD":
                cache[p, :, n % c["page"]:] = float("nan")
            else:
                cache[p, :, :, n % c["page"]:] = float("nan")
    return lens, indptr, indices, last, cache


def _check_requests(out, lse, q, cache, layout, lens, indices, indptr, **kw):
    """Each request's output and base-2 LSE against the reference over its gathered pages (kw:
    the attention's arguments); empty requests give out 0 and LSE -inf."""
    for b, n in enumerate(lens):
        k, v = _gather(cache, layout, indices, indptr, b, n)
        lse_ref = _check_request(f"out[{b}]", out[b:b + 1], q[b:b + 1], k, v, **kw)
        if n == 0:
            assert (out[b] == 0).all() and (lse[b] == float("-inf")).all()
        else:
            torch.testing.assert_close(lse[b], lse_ref[:, 0] / math.log(2), atol=1e-3, rtol=1e-3)


def _planned(c):
    """(case without its dtype, dtype, a decode wrapper planned over case c's stale paged cache,
    (lens, indptr, indices, last, cache))."""
    c = dict(c)
    dtype = c.pop("dtype", BF16)
    paged = _stale_paged(c, dtype)
    lens, indptr, indices, last, cache = paged
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), kv_layout=c["layout"])
    wrapper.plan(indptr, indices.cuda(), last, c["h"], c["h_k"], c["d"], c["page"],
                 q_data_type=dtype, fixed_split_size=c.get("split"))
    return c, dtype, wrapper, paged


@needs_sm90
@pytest.mark.parametrize("form", ["wgmma", "mma16", "early"])
@pytest.mark.parametrize("merge", [False, True, "balanced"],
                         ids=["combine", "merge-in-kernel", "balanced"])
@pytest.mark.parametrize("c", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sm90_decode(c, merge, form, monkeypatch):
    """Outputs and base-2 LSE against per-request references; slots past each request's last key
    hold NaN (stale cache entries) and must not reach the outputs. merge: split requests merged
    by their last item inside the kernel (IOATTN_SM90_DECODE_MERGE) instead of the combine;
    balanced: the balanced split (IOATTN_SM90_DECODE_BALANCED, merged in the kernel), each CTA
    looping over its column's items (explicit splits keep the plain split). mma16: the consumer
    on mma.sync (IOATTN_SM90_DECODE_MMA16; every case's group is <= 16 heads); early: the item
    read before PDL's wait (IOATTN_SM90_DECODE_EARLY), one SM counted, so that only the first
    two CTAs aim L2 prefetches."""
    balanced = merge == "balanced"
    if balanced and form == "early":
        pytest.skip("EARLY is the one-item-a-CTA form's (the balanced form runs as in wgmma)")
    monkeypatch.setattr(sm90_decode, "MMA16", form == "mma16")
    monkeypatch.setattr(sm90_decode, "EARLY", form == "early")
    if form == "early":
        monkeypatch.setattr(sm90_decode, "PDL", True)
        monkeypatch.setattr(sm90_decode, "PREFETCH", True)
        monkeypatch.setattr(sm90_decode, "sm_count", lambda device: 1)
    calls = _sm90_decode_on(monkeypatch, bool(merge), balanced)
    c, dtype, wrapper, (lens, indptr, indices, last, cache) = _planned(c)
    q = torch.randn(c["batch"], c["h"], c["d"], device="cuda", dtype=dtype)
    out, lse = wrapper.run(q, cache, return_lse=True)
    assert calls, "the sm90 decode kernel did not run"
    # (explicit splits stay plain under the balanced split)
    assert all(calls) == (balanced and "split" not in c), calls
    _check_requests(out, lse, q, cache, c["layout"], lens, indices, indptr)


@needs_sm90
@pytest.mark.parametrize("merge", [False, True], ids=["combine", "merge-in-kernel"])
@pytest.mark.parametrize("c", [CASES[1], CASES[2]],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sm90_decode_repeats_per_layer(c, merge, monkeypatch):
    """Three steps over three layers' caches, each step planned anew from a new page-table
    tensor (as an engine plans every step): each layer's first launch is kept
    (``sm90_decode._BOUND``, one per cache; the wrapper's own page-table buffer keeps its
    address from plan to plan) and its repeat in the next step is one C call with the new q,
    out and lse, checked against the references (outputs and LSE poisoned before each call);
    with a Triton launch hook set the kept launches step aside, so the hook sees each of them."""
    import triton

    from ioattn import launch

    monkeypatch.setattr(sm90_decode, "_BOUND", {})
    repeats = []
    orig_call = launch.Bound.__call__
    monkeypatch.setattr(launch.Bound, "__call__",
                        lambda self, *t: repeats.append(orig_call(self, *t)) or repeats[-1])
    calls = _sm90_decode_on(monkeypatch, merge)
    c, dtype, wrapper, (lens, indptr, indices, last, cache) = _planned(c)
    layers = [cache]
    for _ in range(2):  # (other layers' caches: fresh values, the same stale NaN slots)
        layer = torch.randn_like(cache)
        layer[torch.isnan(cache)] = float("nan")
        layers.append(layer)
    for step in range(3):
        if step:  # (the same lengths, a new indices tensor)
            wrapper.plan(indptr, indices.clone().cuda(), last, c["h"], c["h_k"], c["d"],
                         c["page"], q_data_type=dtype, fixed_split_size=c.get("split"))
        if step == 2:
            seen = []
            monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook",
                                lambda meta: seen.append(meta.get()["name"]))
        for layer in layers:
            q = torch.randn(c["batch"], c["h"], c["d"], device="cuda", dtype=dtype)
            out = torch.full_like(q, float("nan"))
            lse = torch.full((c["batch"], c["h"]), float("nan"), device="cuda")
            wrapper.run(q, layer, out=out, lse=lse, return_lse=True)
            _check_requests(out, lse, q, layer, c["layout"], lens, indices, indptr)
    assert len(calls) == 9 and len(sm90_decode._BOUND) == 3, (len(calls), sm90_decode._BOUND)
    # step 1's three launches were repeats; step 2's stepped aside for the hook
    assert repeats == [True] * 3 + [False] * 3, repeats
    assert seen.count("_decode_sm90") == 3, seen


D256_CASES = [dict(batch=4, h=8, h_k=4, d=256, page=16, layout="NHD", max_len=700),
              dict(batch=3, h=16, h_k=8, d=256, page=8, layout="HND", dtype=FP16, split=64,
                   max_len=500),
              dict(batch=2, h=8, h_k=4, d=256, page=64, layout="NHD", max_len=3000)]


@needs_sm90
@pytest.mark.parametrize("merge", [False, True, "balanced"],
                         ids=["combine", "merge-in-kernel", "balanced"])
@pytest.mark.parametrize("c", D256_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sm90_decode_d256(c, merge, monkeypatch):
    """Head dim 256 on the sm90 decode kernel (IOATTN_SM90_DECODE_D256; one CTA an SM, 232
    registers a thread): outputs and base-2 LSE against per-request references, NaN in stale
    slots, split requests combined, merged in the kernel or through the balanced columns."""
    monkeypatch.setattr(sm90_decode, "SUPPORTED_HEAD_DIMS", (64, 128, 256))
    calls = _sm90_decode_on(monkeypatch, bool(merge), merge == "balanced")
    c, dtype, wrapper, (lens, indptr, indices, last, cache) = _planned(c)
    q = torch.randn(c["batch"], c["h"], c["d"], device="cuda", dtype=dtype)
    out, lse = wrapper.run(q, cache, return_lse=True)
    assert calls, "the sm90 decode kernel did not run"
    _check_requests(out, lse, q, cache, c["layout"], lens, indices, indptr)


# (long requests, so each CTA streams many 64-key tiles and the producer's wait for the tile two
# back runs many times: pages of 8, 16 and 32 keys, NHD and HND)
RING_CASES = [CASES[0], CASES[1], CASES[3], CASES[7],
              dict(batch=3, h=8, h_k=2, d=128, page=8, layout="NHD", max_len=1100),
              dict(batch=2, h=16, h_k=4, d=64, page=32, layout="HND", dtype=FP16, max_len=900),
              dict(batch=2, h=4, h_k=1, d=128, page=16, layout="HND", max_len=1300)]


@needs_sm90
@pytest.mark.parametrize("shallow, ahead", [(True, True), (True, False), (False, False)],
                         ids=["shallow", "shallow-rows-after", "deep-rows-after"])
@pytest.mark.parametrize("c", RING_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sm90_decode_ring_depth(c, shallow, ahead, monkeypatch):
    """IOATTN_SM90_DECODE_SHALLOW: two key tiles in flight a CTA, of the ring's three, when the
    launch's (item, KV head) units outnumber the SMs (the count made 1 here, so every case
    takes it; by default only large batches do), or three; IOATTN_SM90_DECODE_ROWS_AHEAD off:
    each tile's page-table entries loaded after the wait for its stage. Pages of 8 to 64 keys
    (1 to 8 copies a tile), long requests (up to 21 tiles a CTA), split requests, ragged
    lengths, stale NaN slots."""
    monkeypatch.setattr(sm90_decode, "SHALLOW", shallow)
    monkeypatch.setattr(sm90_decode, "ROWS_AHEAD", ahead)
    monkeypatch.setattr(sm90_decode, "sm_count", lambda device: 1)
    calls = _sm90_decode_on(monkeypatch)
    c, dtype, wrapper, (lens, indptr, indices, last, cache) = _planned(c)
    q = torch.randn(c["batch"], c["h"], c["d"], device="cuda", dtype=dtype)
    out, lse = wrapper.run(q, cache, return_lse=True)
    assert calls, "the sm90 decode kernel did not run"
    _check_requests(out, lse, q, cache, c["layout"], lens, indices, indptr)


# (d=256: the sm90 kernel's default since session 36, compile-checked in these forms)
FP8_CASES = [dict(CASES[0], big_q=True), CASES[1], CASES[2], CASES[4], CASES[6], CASES[7],
             D256_CASES[0]]


@needs_sm90
@pytest.mark.parametrize("merge", [False, True, "balanced"],
                         ids=["combine", "merge-in-kernel", "balanced"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("c", FP8_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sm90_decode_fp8(c, fp8, merge, monkeypatch):
    """An fp8 cache (kv_data_type) on the sm90 kernel (IOATTN_SM90_DECODE_FP8), its tiles
    converted in shared memory, with k_scale / v_scale, against attention over the dequantized
    cache; NaN in stale slots of each request's last page must not reach the outputs. big_q: bf16
    queries past fp16's range (the kernel scales them by a power of two)."""
    monkeypatch.setattr(sm90_decode, "FP8", True)
    calls = _sm90_decode_on(monkeypatch, bool(merge), merge == "balanced")
    c = dict(c)
    dtype = c.pop("dtype", BF16)
    big_q = c.pop("big_q", False)
    lens, indptr, indices, last, cache = _stale_paged(c, dtype)
    cache8 = cache.to(fp8)  # (NaN in the stale slots stays NaN)
    k_scale, v_scale = 0.5, 2.0
    deq = torch.stack([cache8[:, 0].to(dtype) * k_scale, cache8[:, 1].to(dtype) * v_scale], 1)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), kv_layout=c["layout"])
    scale = (2.0 ** -15 if big_q else 1.0) / math.sqrt(c["d"])
    wrapper.plan(indptr, indices.cuda(), last, c["h"], c["h_k"], c["d"], c["page"],
                 q_data_type=dtype, kv_data_type=fp8, fixed_split_size=c.get("split"),
                 sm_scale=scale)
    q = torch.randn(c["batch"], c["h"], c["d"], device="cuda", dtype=dtype)
    if big_q:  # |q| up to ~2^17, past fp16's 65504, with a score scale to match
        q = q * 2.0 ** 15
    out, lse = wrapper.run(q, cache8, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    assert calls, "the sm90 decode kernel did not run"
    assert all(calls) == (merge == "balanced" and "split" not in c), calls
    _check_requests(out, lse, q, deq, c["layout"], lens, indices, indptr, softmax_scale=scale)


SOFTCAP_CASES = [dict(CASES[0], cap=5.0), dict(CASES[1], cap=30.0),
                 dict(CASES[0], cap=2.0, fp8=torch.float8_e4m3fn, big_q=True),
                 dict(D256_CASES[1], cap=30.0), dict(D256_CASES[0], cap=5.0,
                                                     fp8=torch.float8_e4m3fn)]


@needs_sm90
@pytest.mark.parametrize("merge", [False, True, "balanced"],
                         ids=["combine", "merge-in-kernel", "balanced"])
@pytest.mark.parametrize("c", SOFTCAP_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sm90_decode_softcap(c, merge, monkeypatch):
    """logits_soft_cap on the sm90 kernel (its tanh before the online softmax), against
    per-request references with the cap, base-2 LSE included, stale NaN slots present; the fp8
    case with bf16 queries past fp16's range (the kernel scales q by a power of two, which the
    tanh's argument must undo); balanced: each CTA looping over its column's items."""
    monkeypatch.setattr(sm90_decode, "FP8", True)
    calls = _sm90_decode_on(monkeypatch, bool(merge), merge == "balanced")
    c = dict(c)
    dtype, cap = c.pop("dtype", BF16), c.pop("cap")
    fp8, big_q = c.pop("fp8", None), c.pop("big_q", False)
    lens, indptr, indices, last, cache = _stale_paged(c, dtype)
    run_cache, ref_cache = cache, cache
    if fp8 is not None:
        run_cache = cache.to(fp8)
        ref_cache = run_cache.to(dtype)
    scale = (2.0 ** -15 if big_q else 1.0) / math.sqrt(c["d"])
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), kv_layout=c["layout"])
    wrapper.plan(indptr, indices.cuda(), last, c["h"], c["h_k"], c["d"], c["page"],
                 q_data_type=dtype, kv_data_type=fp8, fixed_split_size=c.get("split"),
                 sm_scale=scale, logits_soft_cap=cap)
    q = 3.0 * torch.randn(c["batch"], c["h"], c["d"], device="cuda", dtype=dtype)
    if big_q:
        q = q * 2.0 ** 15
    out, lse = wrapper.run(q, run_cache, return_lse=True)
    assert calls, "the sm90 decode kernel did not run"
    _check_requests(out, lse, q, ref_cache, c["layout"], lens, indices, indptr,
                    softmax_scale=scale, softcap=cap)


@needs_sm90
@pytest.mark.parametrize("early", [False, True], ids=["", "early"])
@pytest.mark.parametrize("merge", [False, True, "balanced"],
                         ids=["combine", "merge-in-kernel", "balanced"])
def test_sm90_decode_graph_capture_short_replay_long(merge, early, monkeypatch):
    """run() through the sm90 decode kernel captured at short lengths, replayed after a plan with
    long ones (split requests): the fixed grid covers any plan; with the in-kernel merge, the
    tickets return to zero between replays (balanced: the columns' items replanned too). early:
    the item read before PDL's wait (IOATTN_SM90_DECODE_EARLY; CTAs past the plan's items read
    stale WORK rows there)."""
    if early and merge == "balanced":
        pytest.skip("EARLY is the one-item-a-CTA form's (the balanced form runs as without it)")
    monkeypatch.setattr(sm90_decode, "EARLY", early)
    _sm90_decode_on(monkeypatch, bool(merge), merge == "balanced")
    g = torch.Generator().manual_seed(5)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True,
        paged_kv_indices_buffer=torch.empty(4000, dtype=torch.int32, device="cuda"))
    b, h, h_k, d, page = 8, 32, 8, 128, 16
    q = torch.randn(b, h, d, device="cuda", dtype=BF16)
    out = torch.empty_like(q)
    lens, indptr, indices, last, cache = _paged(b, h_k, d, page, BF16, "cuda", max_len=40,
                                                empty=False, g=g)
    big = torch.randn(4000, 2, page, h_k, d, device="cuda", dtype=BF16)
    big[:cache.shape[0]] = cache
    wrapper.plan(indptr, indices.cuda(), last, h, h_k, d, page, q_data_type=BF16)
    wrapper.run(q, big, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, big, out=out)
    replay_long_and_check(wrapper, graph, g, q, out, big, h_k, page)
    if merge:  # every ticket back at zero, and a second replay gives the same outputs
        assert not wrapper._counts.any()
        first = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, first, atol=0, rtol=0)


@needs_sm90
@pytest.mark.parametrize("claim", ["spread", True, False], ids=["spread", "fcfs", "positions"])
@pytest.mark.parametrize("merge", [False, True], ids=["combine", "merge-in-kernel"])
@pytest.mark.parametrize("early", [False, True], ids=["", "early"])
def test_sm90_decode_graph_claims(merge, claim, early, monkeypatch):
    """A graph-mode wrapper launches the bound's grid; where the plan's (item, KV head) units
    fit one an SM, its CTAs claim them SM by SM (IOATTN_SM90_DECODE_CLAIM) instead of taking
    their grid positions' units (spread, the default: only an even subset of SMs claims at
    once, IOATTN_SM90_DECODE_CLAIM_SPREAD; fcfs: first come, first served). One run with the
    counters' reset held off shows that every CTA claimed once (or, claims off, none did). Then three PDL-launched runs back to back
    (sharing the counters), eager and captured in one graph, replayed under that plan, a second
    that claims and a third with more units than SMs (the claiming kernel keeping its grid
    positions); outputs (poisoned before each run and each replay) and LSE against the
    references, and the counters back at zero after each."""
    monkeypatch.setattr(sm90_decode, "PDL", True)
    monkeypatch.setattr(sm90_decode, "EARLY", early)  # (IOATTN_SM90_DECODE_EARLY)
    monkeypatch.setattr(sm90_decode, "CLAIM", bool(claim))
    monkeypatch.setattr(sm90_decode, "CLAIM_SPREAD", claim == "spread")
    _sm90_decode_on(monkeypatch, merge)
    claims = []  # the claim counters each launch got (argument 18)
    inner = sm90_decode.paged_decode_sm90
    monkeypatch.setattr(sm90_decode, "paged_decode_sm90",
                        lambda *a, **kw: claims.append(a[18]) or inner(*a, **kw))
    g = torch.Generator().manual_seed(11)
    b, h, h_k, d, page = 6, 32, 8, 128, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True,
        paged_kv_indices_buffer=torch.empty(4000, dtype=torch.int32, device="cuda"))
    big = torch.randn(4000, 2, page, h_k, d, device="cuda", dtype=BF16)
    qs = [torch.randn(b, h, d, device="cuda", dtype=BF16) for _ in range(3)]
    outs = [torch.empty_like(q) for q in qs]
    lses = [torch.empty(b, h, device="cuda", dtype=torch.float32) for _ in qs]

    def plan(lens, claiming):
        pages = [(n + page - 1) // page for n in lens]
        indices = torch.randperm(4000, generator=g)[:sum(pages)].to(torch.int32)
        indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)], dtype=torch.int32)
        wrapper.plan(indptr, indices.cuda(), last, h, h_k, d, page, q_data_type=BF16)
        units = wrapper._n_items * h_k
        assert units < wrapper._max_items * h_k, (units, wrapper._max_items)
        # claiming: the work fits one unit an SM on the larger grid
        assert (units <= sms) == claiming, (units, sms)
        return lens, indptr, indices

    def poison():  # the runs must write every element again
        for t in outs + lses:
            t.fill_(float("nan"))

    def check(lens, indptr, indices):
        for q, out, lse in zip(qs, outs, lses):
            _check_requests(out, lse, q, big, "NHD", lens, indices, indptr)
        assert not wrapper._claims.any(), wrapper._claims
        if merge:
            assert not wrapper._counts.any()

    def step():
        for q, out, lse in zip(qs, outs, lses):
            wrapper.run(q, big, out=out, lse=lse, return_lse=True)

    # (lengths whose plans split some requests yet stay within one unit an SM: 96 and 80 units;
    # the third, 144 units)
    first = plan([300, 650, 17, 480, 211, 555], True)
    ctas = wrapper._max_items * h_k
    wrapper._claims[1] = -(1 << 20)  # the last claimant's ticket never comes: no reset
    wrapper.run(qs[0], big, out=outs[0], lse=lses[0], return_lse=True)
    torch.cuda.synchronize()
    got = wrapper._claims.tolist()
    if claim:  # every CTA claimed once, counted once on its SM
        assert got[0] == ctas and got[1] == ctas - (1 << 20) and sum(got[2:]) == ctas, got[:2]
    else:
        assert got[0] == 0 and got[1] == -(1 << 20) and not any(got[2:]), got[:2]
    wrapper._claims.zero_()
    poison()
    step()
    torch.cuda.synchronize()
    assert len(claims) == 4 and all(c is wrapper._claims for c in claims), claims
    check(*first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens, claiming in ((None, True), ([1500, 3000, 9000, 120, 2500, 700], True),
                           ([3000] * 6, False)):
        p = first if lens is None else plan(lens, claiming)
        for _ in range(2):
            poison()
            graph.replay()
            torch.cuda.synchronize()
            check(*p)


@needs_sm90
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("merge", [False, True, "balanced"],
                         ids=["combine", "merge-in-kernel", "balanced"])
@pytest.mark.parametrize("c", [CASES[0], CASES[1], CASES[4], CASES[6]],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sm90_decode_pdl_heads_first(c, merge, prefetch, monkeypatch):
    """IOATTN_SM90_DECODE_PDL and IOATTN_SM90_DECODE_HEADS_FIRST (both on by default): the
    kernel launched with programmatic dependent launch (the switch, or FlashInfer's
    run(enable_pdl=True)), on a (KV heads, items) grid. Three runs back to back, eager and then
    captured in one graph and replayed twice, every output and LSE (poisoned
    before the replays) against the references. With the in-kernel merge each decode may start
    while the one before it finishes, sharing its partial slots and merge tickets (a missing
    wait would show only by chance: the check is of the results); with the combine, the
    combine kernel (not PDL-launched) sits between them. prefetch (IOATTN_SM90_DECODE_PREFETCH):
    each CTA's L2 prefetches before its wait change nothing in the results."""
    monkeypatch.setattr(sm90_decode, "PDL", True)
    monkeypatch.setattr(sm90_decode, "PREFETCH", prefetch)
    monkeypatch.setattr(sm90_decode, "HEADS_FIRST", True)
    balanced = merge == "balanced"
    calls = _sm90_decode_on(monkeypatch, bool(merge), balanced)
    pdls = []  # run()'s enable_pdl as it reached the launch (argument 17)
    inner = sm90_decode.paged_decode_sm90
    monkeypatch.setattr(sm90_decode, "paged_decode_sm90",
                        lambda *a, **kw: pdls.append(a[17]) or inner(*a, **kw))
    c, dtype, wrapper, (lens, indptr, indices, last, cache) = _planned(c)
    qs = [torch.randn(c["batch"], c["h"], c["d"], device="cuda", dtype=dtype) for _ in range(3)]
    outs = [torch.empty_like(q) for q in qs]
    lses = [torch.empty(c["batch"], c["h"], device="cuda", dtype=torch.float32) for _ in qs]

    def step():  # (the middle run through the switch, the others through enable_pdl)
        for i, (q, out, lse) in enumerate(zip(qs, outs, lses)):
            wrapper.run(q, cache, out=out, lse=lse, return_lse=True,
                        enable_pdl=None if i == 1 else True)

    step()
    torch.cuda.synchronize()
    assert len(calls) == 3 and all(calls) == (balanced and "split" not in c), calls
    assert pdls == [True, None, True], pdls
    for q, out, lse in zip(qs, outs, lses):
        _check_requests(out, lse, q, cache, c["layout"], lens, indices, indptr)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in outs + lses:  # poisoned: the replays must write every element again
        t.fill_(float("nan"))
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    for q, out, lse in zip(qs, outs, lses):
        _check_requests(out, lse, q, cache, c["layout"], lens, indices, indptr)
    if merge:
        assert not wrapper._counts.any()


@needs_sm90
def test_sm90_decode_leaves_windows_to_the_portable_kernel(monkeypatch):
    """A sliding window is outside the sm90 decode kernel's coverage (the aligned first tile
    would read slots before the window): with the switch on, such a plan runs the portable
    kernel, correctly."""
    calls = _sm90_decode_on(monkeypatch)
    g = torch.Generator().manual_seed(7)
    lens, indptr, indices, last, cache = _paged(4, 2, 128, 16, BF16, "cuda", "NHD", 300, g=g)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(32 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(indptr, indices.cuda(), last, 8, 2, 128, 16, window_left=40, q_data_type=BF16)
    q = torch.randn(4, 8, 128, device="cuda", dtype=BF16)
    out = wrapper.run(q, cache)
    assert not calls
    for b, n in enumerate(lens):
        k, v = _gather(cache, "NHD", indices, indptr, b, n)
        _check_request(f"out[{b}]", out[b:b + 1], q[b:b + 1], k, v, window_size=(40, -1))

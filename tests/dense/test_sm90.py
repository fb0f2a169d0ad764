"""The Gluon sm90 forward (FlashAttention-3 design), forced with backend='sm90' on Hopper, and the
dispatch rules around it (run anywhere). The whole dense suite also runs through backend='auto',
which picks this kernel on sm90 wherever it covers the call."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import triton

import ioattn
from ioattn.dispatch import sm90_unavailable_reason
from ioattn.reference import attention_ref, attention_varlen_ref
from ioattn.testing import GRAD_FACTOR, assert_close_rule, cu_seqlens
from tests.dense.test_attention import FP16, Case, _check_grads, _inputs, _varlen_inputs

SM90 = torch.cuda.is_available() and sm90_unavailable_reason(torch.device("cuda")) is None
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (H100/H200) with Triton 3.6.x")

CASES = [
    Case(1, 1, d=64),
    Case(113, 203, d=64),
    Case(113, 203, d=128, causal=True),
    Case(203, 113, d=128, causal=True),  # s_q > s_k: the first 90 rows see no key
    Case(128, 217, d=64, window=(33, 0), dtype=FP16),
    Case(256, 128, d=128, window=(17, 5)),
    Case(300, 37, d=128, window=(-1, 7)),
    Case(1023, 1024, d=128, causal=True, dtype=FP16),
    Case(1024, 1023, d=64, h=8, h_k=2),
    Case(2048, 2048, d=128, causal=True, b=1, h=8, h_k=1),
    Case(777, 777, d=128, h=6, h_k=3, window=(100, -1)),
    Case(4096, 4096, d=64, causal=True, b=1, h=2),
    Case(113, 203, d=256),
    Case(1024, 1023, d=256, causal=True, b=1, h=2, dtype=FP16),
    Case(300, 300, d=256, h=4, h_k=2, window=(50, 20)),
    # zero-padded head dims: 96 runs as 128, 192 (and 192 / 128) as 256
    Case(113, 203, d=96),
    Case(1023, 1024, d=96, causal=True, dtype=FP16, h=4, h_k=2),
    Case(300, 300, d=192, h=4, h_k=2, window=(50, 20)),
    Case(203, 300, d=192, d_v=128, causal=True, h=4, h_k=1),
]


def _check_fwd(c: Case, out, lse, ref, lse_ref, pt):
    assert_close_rule("out", out, ref, pt)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "LSE -inf pattern differs (fully masked rows)"
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=1e-3, rtol=1e-3)


def _covers_bwd(c: Case) -> bool:
    from ioattn.dense.sm90_bwd import unsupported_reason

    return unsupported_reason(c.d, c.d_v or c.d, c.softcap, False, 0.0) is None


@needs_sm90
@pytest.mark.parametrize("c", CASES, ids=lambda c: "sm90-" + c.id)
def test_sm90_fwd_bwd(c: Case):
    """backend='sm90' end to end: the Gluon forward, and the Gluon backward where it covers the
    head dim (d=256 has an sm90 forward only: there the forward runs without a gradient)."""
    _fwd_bwd(c, _covers_bwd(c) and c.s_q * c.s_k <= 1024 * 1024)


def _case_inputs(c: Case):
    """(q, k, v, score kwargs) of a case; with softcap, scores large enough for the cap to bend
    them (as tests/dense/test_attention.py)."""
    q, k, v = _inputs(c, "cuda", scale=1.5 if c.softcap else 1.0)
    kw = dict(causal=c.causal, window_size=c.window)
    if c.softcap:
        kw["softcap"] = c.softcap
    return q, k, v, kw


def _fwd_bwd(c: Case, grads: bool, deterministic: bool = False):
    """backend='sm90' forward of a case checked against the reference (output and LSE), and
    with grads every gradient too."""
    q, k, v, kw = _case_inputs(c)
    args = (q, k, v) if grads else (q.detach(), k.detach(), v.detach())
    out, lse, _ = ioattn.flash_attn_func(*args, return_attn_probs=True, backend="sm90",
                                         deterministic=deterministic, **kw)
    ref, lse_ref = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    _check_fwd(c, out, lse, ref, lse_ref, pt)
    if grads:
        _check_grads(c.id, out, ref, pt, torch.randn_like(out), (q, k, v))


def _forward_only(c: Case):
    """backend='sm90' forward of a case, checked against the reference (output and LSE);
    returns (q, k, v, score kwargs, out)."""
    q, k, v, kw = _case_inputs(c)
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse, _ = ioattn.flash_attn_func(q, k, v, return_attn_probs=True, backend="sm90", **kw)
    ref, lse_ref = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    _check_fwd(c, out, lse, ref, lse_ref, pt)
    return q, k, v, kw, out


def _matches_varlen(c: Case, q, k, v, kw, out) -> None:
    """(equal-length cases without a left window) the same rows packed as varlen give out."""
    if c.s_q == c.s_k and c.window[0] < 0:
        cu = cu_seqlens([c.s_q] * c.b, "cuda")
        flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
        out_v = ioattn.flash_attn_varlen_func(*flat, cu, cu, c.s_q, c.s_k, backend="sm90", **kw)
        torch.testing.assert_close(out_v.view_as(out).float(), out.float(), atol=1e-2, rtol=0)


def _recorded_calls(monkeypatch, cls) -> list:
    """What each call of ``cls``'s instances (a kept launch) returns, recorded in order."""
    results = []
    orig_call = cls.__call__
    monkeypatch.setattr(cls, "__call__",
                        lambda self, *a: results.append(orig_call(self, *a)) or results[-1])
    return results


@needs_sm90
@pytest.mark.parametrize("c", [CASES[2], CASES[8], CASES[12], CASES[16], CASES[9]],
                         ids=lambda c: "sm90-bind-" + c.id)
def test_sm90_fwd_bind(c: Case, monkeypatch):
    """IOATTN_SM90_FWD_BIND: the forward's launches kept by call form (``sm90_fwd._BOUND``) and
    repeated in one C call with each call's tensors (descriptors encoded at their addresses):
    three rounds of a case with fresh inputs (and its varlen form where it has one), each
    against the reference; every round after the first is a repeat, none steps aside."""
    from ioattn import launch
    from ioattn.dense import sm90_fwd

    monkeypatch.setattr(sm90_fwd, "BIND", True)
    monkeypatch.setattr(sm90_fwd, "_BOUND", {})
    repeats = _recorded_calls(monkeypatch, launch.Bound)
    for _ in range(3):
        q, k, v, kw, out = _forward_only(c)
        _matches_varlen(c, q, k, v, kw, out)
    assert sm90_fwd._BOUND and len(repeats) >= 2 and all(repeats), repeats


@needs_sm90
@pytest.mark.parametrize("c, deterministic", [
    (CASES[2], False), (CASES[2], True), (CASES[8], False), (CASES[8], True), (CASES[5], False),
    (CASES[12], False), (CASES[16], False)],
    ids=["d128-causal", "d128-causal-two-kernel", "d64-gqa", "d64-gqa-two-kernel", "d128-window",
         "d256", "d96-padded"])
def test_sm90_bwd_bind(c: Case, deterministic, monkeypatch):
    """IOATTN_SM90_BWD_BIND: the backward's launches kept by the op's signature
    (``sm90_bwd._BOUND``: preprocess, dK/dV, dQ or the fused form's conversion) and repeated with
    each call's tensors: four rounds of a case with fresh inputs, every gradient against the
    reference. Each round's tensors stay alive, and blocks of the backward's own delta and fp32
    dQ buffer are taken after it, so no round reuses another's addresses. The second and third
    rounds are repeats; the fourth, with a launch hook set, steps aside (the plain launches)."""
    from ioattn.dense import op, sm90_bwd

    monkeypatch.setattr(op, "BIND", True)
    monkeypatch.setattr(sm90_bwd, "BIND", True)
    monkeypatch.setattr(sm90_bwd, "_BOUND", {})
    kept = _recorded_calls(monkeypatch, sm90_bwd._Kept)
    alive = []
    for i in range(4):
        if i == 3:
            monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda meta: None)
        q, k, v, kw = _case_inputs(c)
        out, lse, _ = ioattn.flash_attn_func(q, k, v, backend="sm90", deterministic=deterministic,
                                             return_attn_probs=True, **kw)
        ref, _ = attention_ref(q, k, v, **kw)
        pt, _ = attention_ref(q, k, v, upcast=False, **kw)
        g = torch.randn_like(out)
        got = _check_grads(c.id, out, ref, pt, g, (q, k, v))
        d = sm90_bwd.PADDED_HEAD_DIMS.get((c.d, c.d), c.d)
        alive.append((q, k, v, out, g, got, torch.empty_like(lse),
                      q.new_empty(q.shape[:-1] + (d,), dtype=torch.float32)))
    assert len(sm90_bwd._BOUND) == 1 and kept == [True, True, False], kept


@needs_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_fwd_stream_counters(causal, monkeypatch):
    """IOATTN_SM90_FWD_STREAM_COUNTERS: the persistent forward's tile counter kept per stream and
    zeroed by each launch's last CTA (``sm90_fwd._tile_counter``). On a grid of 3 CTAs (64
    tiles: nearly every tile drawn from the counter, so a counter left dirty skips tiles),
    back-to-back launches on one stream and one on a second stream in between each give the
    reference's output, and every kept counter reads zero afterwards; a captured graph (its
    own counter, zeroed by the capture's torch.zeros at each replay) replayed with new inputs
    gives the reference's too."""
    from ioattn.dense import sm90_fwd

    monkeypatch.setattr(sm90_fwd, "STREAM_COUNTERS", True)
    monkeypatch.setattr(sm90_fwd, "_COUNTERS", {})
    monkeypatch.setattr(sm90_fwd, "sm_count", lambda device: 3)
    c = Case(1024, 1024, d=128, causal=causal, b=2, h=4, h_k=2)
    assert sm90_fwd.launch_form(128, False, "causal" if causal else "none", 1024)["DYNAMIC"]
    side = torch.cuda.Stream()
    rounds = [_case_inputs(c) for _ in range(5)]
    outs = []
    for i, (q, k, v, kw) in enumerate(rounds):
        stream = side if i == 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outs.append(ioattn.flash_attn_func(q.detach(), k.detach(), v.detach(),
                                               backend="sm90", **kw))
        torch.cuda.current_stream().wait_stream(stream)
    for (q, k, v, kw), out in zip(rounds, outs):
        assert_close_rule("out", out, attention_ref(q, k, v, **kw)[0],
                          attention_ref(q, k, v, upcast=False, **kw)[0])
    torch.cuda.synchronize()
    assert len(sm90_fwd._COUNTERS) == 2
    assert all(t.tolist() == [0, 0] for t in sm90_fwd._COUNTERS.values())
    # captured: the graph's own counter (its zeroing captured with it)
    q0, k0, v0, kw = (t.detach().clone() if torch.is_tensor(t) else t for t in rounds[0])
    graph_stream = torch.cuda.Stream()
    graph_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(graph_stream):
        ioattn.flash_attn_func(q0, k0, v0, backend="sm90", **kw)  # (warm, outside capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=graph_stream):
            g_out = ioattn.flash_attn_func(q0, k0, v0, backend="sm90", **kw)
    torch.cuda.synchronize()
    kept = len(sm90_fwd._COUNTERS)
    for q, k, v, _ in rounds[1:]:
        q0.copy_(q), k0.copy_(k), v0.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_rule("out", g_out, attention_ref(q, k, v, **kw)[0],
                          attention_ref(q, k, v, upcast=False, **kw)[0])
    assert len(sm90_fwd._COUNTERS) == kept  # (capture took no kept counter)
    assert all(t.tolist() == [0, 0] for t in sm90_fwd._COUNTERS.values())


WG3_CASES = [Case(113, 203, d=64), Case(203, 113, d=64, causal=True),
             Case(1023, 1024, d=64, causal=True, dtype=FP16, b=3, h=3),
             Case(777, 777, d=64, h=6, h_k=3, window=(100, -1)), Case(192, 192, d=64, h=2),
             Case(128, 217, d=64, window=(33, 0), dtype=FP16)]


@needs_sm90
@pytest.mark.parametrize("pingpong,block_n", [("auto", "64"), ("1", "64"), ("auto", "128"),
                                              ("1", "128")],
                         ids=["default", "pingpong", "wide", "wide-pingpong"])
@pytest.mark.parametrize("c", WG3_CASES, ids=lambda c: "sm90-wg3-" + c.id)
def test_sm90_fwd_three_warpgroups(c: Case, pingpong, block_n, monkeypatch):
    """d=64 forward with three consumer warpgroups (192-row tiles; the default, which
    IOATTN_SM90_FWD_WG3=0 turns off), batched and varlen; with their GEMMs issued in turns,
    round robin (IOATTN_SM90_PINGPONG=1), and on 128-key tiles (IOATTN_SM90_WG3_BLOCK_N=128)."""
    from ioattn.dense import sm90_fwd

    monkeypatch.setattr(sm90_fwd, "WG3", True)
    monkeypatch.setattr(sm90_fwd, "PINGPONG", pingpong)
    monkeypatch.setattr(sm90_fwd, "WG3_BLOCK_N", block_n)
    q, k, v, kw, out = _forward_only(c)
    _matches_varlen(c, q, k, v, kw, out)


PERSISTENT_CASES = [Case(113, 203, d=64), Case(203, 113, d=128, causal=True),
                    Case(1023, 1024, d=128, causal=True, dtype=FP16, b=3, h=3),
                    Case(777, 777, d=128, h=6, h_k=3, window=(100, -1)),
                    Case(300, 300, d=256, h=4, h_k=2, window=(50, 20)),
                    Case(2048, 2048, d=64, b=1, h=40),  # 640 tiles on 132 SMs: CTAs loop
                    Case(2048, 2048, d=128, causal=True, b=1, h=24),  # (384 tiles)
                    # bottom-right causal with more queries than keys: tiles with no key
                    Case(1000, 100, d=64, causal=True, h=4, h_k=2),
                    Case(300, 300, d=64, h=2, window=(50, 20)),
                    # batched causal d=64 from 4k: FA3's 192x128 tile by default
                    Case(4133, 4133, d=64, causal=True, b=1, h=2, h_k=1),
                    # d=256 (persistent when forced: 2 ring stages, O from registers) on more
                    # tiles than SMs, with and without a causal mask
                    Case(2048, 2048, d=256, b=1, h=20),
                    Case(1023, 1023, d=256, causal=True, b=3, h=16, h_k=4)]


@needs_sm90
@pytest.mark.parametrize("mode", ["0", "static", "dynamic", "dynamic-o-regs", "dynamic-o-nodefer",
                                  "dynamic-wg3", "dynamic-wg3-pingpong",
                                  "dynamic-wg3-wide-pingpong", "dynamic-qbufs2",
                                  "static-qbufs2", "dynamic-qbufs1"])
@pytest.mark.parametrize("c", PERSISTENT_CASES, ids=lambda c: "sm90-persistent-" + c.id)
def test_sm90_persistent_fwd(c: Case, mode, monkeypatch):
    """The sm90 forward's tile schedules (IOATTN_SM90_PERSISTENT; by default dynamic at d=64 and
    128): one CTA per tile; persistent CTAs walking the tiles in static snake order, or with ids
    drawn from an atomic counter and passed to the consumers through shared memory (the K/V
    ring and the barrier phases run on across tiles, O is stored from registers while the next
    tile's Q loads); at d=64 also with three consumer warpgroups (IOATTN_SM90_WG3_PERSISTENT),
    and those taking turns round robin (IOATTN_SM90_PINGPONG=1: the turns run on across tiles);
    O staged in each tile's last V stage and stored by TMA, partial row halves from registers
    (IOATTN_SM90_FWD_O_TMA, the default, the stage released a block into the next tile,
    IOATTN_SM90_FWD_O_DEFER, the default; "o-regs": every row from registers; "o-nodefer": the
    stage waited for at the store); "qbufs2": Q in two buffers taken by the tiles in turn
    (IOATTN_SM90_FWD_Q_BUFS=2, d = 64 / 128; by default up to 8k keys, so the other modes run
    it too) on 3 CTAs, so each walks many tiles, tiles without a key block (which take no
    buffer) among them; "qbufs1": one Q buffer (the default beyond 8k keys) on 3 CTAs. Run
    twice: the counter is zeroed per launch."""
    from ioattn.dense import sm90_fwd

    for n in ("1", "2"):
        if mode.endswith("-qbufs" + n):  # (on 3 CTAs)
            monkeypatch.setattr(sm90_fwd, "sm_count", lambda device: 3)
            monkeypatch.setattr(sm90_fwd, "Q_BUFS", n)
            mode = mode.removesuffix("-qbufs" + n)
    if mode == "dynamic-o-regs":
        monkeypatch.setattr(sm90_fwd, "O_TMA", False)
        mode = "dynamic"
    if mode == "dynamic-o-nodefer":
        monkeypatch.setattr(sm90_fwd, "O_DEFER", False)
        mode = "dynamic"

    if mode.startswith("dynamic-wg3"):
        if c.d != 64:
            pytest.skip("three consumer warpgroups run at d=64 only")
        monkeypatch.setattr(sm90_fwd, "WG3", True)
        monkeypatch.setattr(sm90_fwd, "WG3_PERSISTENT", True)
        if mode.endswith("pingpong"):
            monkeypatch.setattr(sm90_fwd, "PINGPONG", "1")
        if "wide" in mode:  # FA3's d=64 tile: 192 x 128
            monkeypatch.setattr(sm90_fwd, "WG3_BLOCK_N", "128")
        mode = "dynamic"
    monkeypatch.setattr(sm90_fwd, "PERSISTENT_MODE", mode)
    _forward_only(c)
    _forward_only(c)


@needs_sm90
@pytest.mark.parametrize("mode", ["dynamic", "static", "o-regs"])
@pytest.mark.parametrize("c", [Case(1023, 1023, d=128, b=2, h=4),
                               Case(1023, 1023, d=128, b=2, h=4, causal=True),
                               Case(203, 1023, d=128, h=6, h_k=2, causal=True, dtype=FP16),
                               # the first 820 rows see no key: tiles without a key block
                               Case(1023, 203, d=128, b=2, h=4, causal=True),
                               Case(113, 203, d=128, softcap=5.0),
                               Case(1, 1, d=128),
                               Case(2048, 2048, d=256, b=1, h=3),
                               Case(1023, 1023, d=256, b=2, h=4, h_k=2, causal=True, dtype=FP16),
                               Case(1, 1, d=256),
                               # padded head dims keep Q in shared memory under the switch
                               Case(113, 203, d=96), Case(113, 203, d=192, causal=True)],
                         ids=lambda c: "q-regs-" + c.id)
def test_sm90_fwd_q_regs(c: Case, mode, monkeypatch):
    """IOATTN_SM90_FWD_Q_REGS (opt-in): Q's first columns (d=128: all, d=256: 64) as Q·Kᵀ's
    register operand, the rest from shared memory; the forward as without it. d=128 (all of Q,
    persistent: Q's one buffer released once loaded) also on 3 CTAs, so each walks many tiles,
    and with the static schedule and O stored from registers."""
    from ioattn.dense import sm90_fwd

    if mode != "dynamic" and c.d != 128:
        pytest.skip("the persistent d=128 form's variants")
    monkeypatch.setattr(sm90_fwd, "Q_REGS_ON", True)
    if mode == "static":
        monkeypatch.setattr(sm90_fwd, "PERSISTENT_MODE", "static")
    if mode == "o-regs":
        monkeypatch.setattr(sm90_fwd, "O_TMA", False)
    if c.d in (128, 256):
        assert sm90_fwd.launch_form(c.d, False, "causal" if c.causal else "none",
                                    c.s_q, c.s_k).get("Q_REGS") == (128 if c.d == 128 else 64)
    _forward_only(c)
    if c.d == 128:
        monkeypatch.setattr(sm90_fwd, "sm_count", lambda device: 3)
        _forward_only(c)


def test_fwd_q_regs_rule(monkeypatch):
    """IOATTN_SM90_FWD_Q_REGS (opt-in): batched d=128 forms hold all of Q in registers (one Q
    buffer, released once loaded; the exponentials early without a mask), d=256 its first 64
    columns; d=64, windows and varlen keep Q in shared memory; off: no form has Q_REGS."""
    from ioattn.dense import sm90_fwd

    form = sm90_fwd.launch_form
    assert all("Q_REGS" not in form(d, False, m, 4096) for d in (64, 128, 256)
               for m in ("none", "causal"))
    monkeypatch.setattr(sm90_fwd, "Q_REGS_ON", True)
    for mask in ("none", "causal"):
        f = form(128, False, mask, 4096)
        assert (f["Q_REGS"], f["Q_BUFS"]) == (128, 1), f
        assert f["EXP_EARLY"] or mask == "causal"
        assert form(256, False, mask, 4096)["Q_REGS"] == 64
        assert "Q_REGS" not in form(64, False, mask, 4096)
        assert "Q_REGS" not in form(128, True, mask, 4096)  # varlen
    assert "Q_REGS" not in form(128, False, "window", 4096)
    assert "Q_REGS" not in form(128, False, "none", 4096, q_regs=False)  # (padded head dims)
    monkeypatch.setattr(sm90_fwd, "PERSISTENT_MODE", "0")  # one CTA a tile: d=128 spills
    assert "Q_REGS" not in form(128, False, "causal", 4096)
    assert form(256, False, "causal", 4096)["Q_REGS"] == 64


def test_fwd_q_bufs_rule(monkeypatch):
    """IOATTN_SM90_FWD_Q_BUFS: two Q buffers in the persistent forward at d = 64 (its stages
    kept) and d = 128 (two stages then, for shared memory); one elsewhere (d = 256, varlen).
    "auto" (the default): two up to 8192 keys (max_seqlen_k, max_seqlen_q if not given), one
    beyond, and one at d = 64 without a mask; 1 / 2 force it."""
    from ioattn.dense import sm90_fwd

    form = sm90_fwd.launch_form
    shapes = ((64, "causal", 2048), (64, "causal", 8192), (64, "none", 8192))
    monkeypatch.setattr(sm90_fwd, "Q_BUFS", "1")
    base = [form(64, False, mask, s) for _, mask, s in shapes]
    assert all(f["Q_BUFS"] == 1 for f in base)
    monkeypatch.setattr(sm90_fwd, "Q_BUFS", "2")
    for (d, mask, s), b in zip(shapes, base):  # (O staged in the tile's Q buffer: O_TMA 3)
        assert form(d, False, mask, s) == dict(b, Q_BUFS=2, O_TMA=3), (d, mask, s)
        assert form(d, False, mask, s, 16384)["Q_BUFS"] == 2
    assert form(128, False, "none", 8192)["Q_BUFS"] == 2
    assert form(128, False, "none", 8192)["STAGES"] == 2
    assert form(256, False, "none", 8192)["Q_BUFS"] == 1
    assert form(128, True, "causal", 8192)["Q_BUFS"] == 1  # varlen: one CTA a tile
    monkeypatch.setattr(sm90_fwd, "Q_BUFS", "auto")
    for (d, mask, s), b in zip(shapes, base):
        two = mask != "none"
        assert form(d, False, mask, s) == (dict(b, Q_BUFS=2, O_TMA=3) if two else b), (d, mask, s)
        assert form(d, False, mask, s, 16384) == b, (d, mask, s)
    assert form(64, False, "window", 2048)["Q_BUFS"] == 2
    assert form(128, False, "causal", 8192)["Q_BUFS"] == 2
    assert form(128, False, "causal", 16384)["Q_BUFS"] == 1
    assert form(128, False, "causal", 512, 8193)["Q_BUFS"] == 1  # by the keys
    assert form(128, False, "none", 16384, 8192)["Q_BUFS"] == 2
    assert form(256, False, "none", 2048)["Q_BUFS"] == 1


def test_sm90_persistent_schedule_rule(monkeypatch):
    """'auto' runs batched forwards at d=64 and 128 on the dynamic scheduler, d=256 and varlen
    with one CTA per tile (d=64 then on three consumer warpgroups); the switch overrides."""
    from ioattn.dense import sm90_fwd

    monkeypatch.setattr(sm90_fwd, "PERSISTENT_MODE", "auto")
    assert [sm90_fwd._schedule(d, False) for d in (64, 128, 256)] == ["dynamic", "dynamic", None]
    assert sm90_fwd._schedule(128, True) is None
    monkeypatch.setattr(sm90_fwd, "WG3", True)
    monkeypatch.setattr(sm90_fwd, "WG3_PERSISTENT", False)
    assert sm90_fwd._wgs(64, False) == 2 and sm90_fwd._wgs(64, True) == 3
    monkeypatch.setattr(sm90_fwd, "WG3_PERSISTENT", True)
    assert sm90_fwd._wgs(64, False) == 3 and sm90_fwd._wgs(128, False) == 2
    # FA3's 192x128 tile: batched d=64 from 2k queries without a mask (with the exponentials
    # early, or not at all) and from 4k causal; the switch forces 64 / 128
    monkeypatch.setattr(sm90_fwd, "WG3_PERSISTENT", False)
    monkeypatch.setattr(sm90_fwd, "WG3_BLOCK_N", "auto")
    monkeypatch.setattr(sm90_fwd, "EXP_EARLY_MODE", "auto")
    wide, early = sm90_fwd._wide, sm90_fwd._exp_early
    assert wide(64, False, "causal", 4096) and not wide(64, False, "causal", 2048)
    assert wide(64, False, "none", 2048) and not wide(64, False, "none", 1024)
    assert not wide(64, False, "window", 16384) and not wide(64, True, "causal", 16384)
    assert not wide(64, True, "none", 16384) and not wide(128, False, "causal", 16384)
    assert early(64, True, "none") and not early(64, True, "causal")
    assert not early(64, False, "none") and not early(128, False, "none")
    form = sm90_fwd.launch_form(64, False, "none", 8192)
    assert (form["WGS"], form["BLOCK_N"], form["EXP_EARLY"]) == (3, 128, True)
    assert not sm90_fwd.launch_form(64, False, "causal", 8192)["EXP_EARLY"]
    with pytest.raises(ValueError, match="mask"):
        sm90_fwd.launch_form(64, False, "full", 8192)
    assert sm90_fwd._wgs(64, False, wide=True) == 3 and sm90_fwd._tile(64, 3, True)[0] == 128
    assert sm90_fwd._tile(64, 3)[0] == 64
    monkeypatch.setattr(sm90_fwd, "EXP_EARLY_MODE", "0")  # then the 128x128 tile without a mask
    assert not wide(64, False, "none", 16384) and not early(64, True, "none")
    monkeypatch.setattr(sm90_fwd, "EXP_EARLY_MODE", "1")
    assert early(128, False, "causal")
    monkeypatch.setattr(sm90_fwd, "WG3_BLOCK_N", "128")
    assert wide(64, True, "window", 100)
    monkeypatch.setattr(sm90_fwd, "WG3_BLOCK_N", "64")
    assert not wide(64, False, "causal", 16384)
    for mode, want in (("0", None), ("1", "static"), ("static", "static"), ("dynamic", "dynamic")):
        monkeypatch.setattr(sm90_fwd, "PERSISTENT_MODE", mode)
        assert sm90_fwd._schedule(256, False) == want


FUSED_CASES = [Case(113, 203, d=64), Case(113, 203, d=128, causal=True),
               Case(203, 113, d=128, causal=True, dtype=FP16),
               Case(256, 300, d=128, h=6, h_k=2, window=(40, 10)),
               Case(1024, 1024, d=128, causal=True, b=2, h=2), Case(777, 777, d=64, h=4, h_k=1),
               Case(40, 300, d=128, h=2),  # one query tile: one step per key block
               Case(1000, 100, d=64, causal=True)]


@needs_sm90
@pytest.mark.parametrize("order", ["after", "first", "lag", "alt"])
@pytest.mark.parametrize("c", FUSED_CASES, ids=lambda c: "sm90-fused-bwd-" + c.id)
def test_sm90_fused_bwd(c: Case, order, monkeypatch):
    """The fused sm90 backward (dQ added by TMA reductions; the default, sm90_bwd.FUSED) against
    the reference's gradients, with each step's dQ partial issued after or before dK's update, or
    one step late (before the next step's dS), or (d=64) formed
    by one warpgroup a step in turn (IOATTN_SM90_BWD_DQ_ORDER)."""
    from ioattn.dense import op
    from ioattn.dense.params import make_params
    from ioattn.dense.sm90_bwd import attn_bwd_sm90
    from ioattn.testing import GRAD_FACTOR

    if order == "alt" and c.d != 64:
        pytest.skip("one partial a step in turn: d=64 only")
    _bwd_order(monkeypatch, order)
    q, k, v = _inputs(c, "cuda")
    left, right = c.window[0], 0 if c.causal else c.window[1]
    out, lse = op.dense_fwd(q, k, v, None, None, c.s_q, c.s_k, c.d ** -0.5, left, right, 0.0, None,
                            0.0, None, "sm90")
    dout = torch.randn_like(out)
    p = make_params(q, k, v, None, None, c.s_q, c.s_k, c.d ** -0.5, left, right, 0.0, None, 0.0, None)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    attn_bwd_sm90(p, dout, q.detach(), k.detach(), v.detach(), out, lse, None, dq, dk, dv,
                  torch.empty_like(lse), fused=True)
    kw = dict(causal=c.causal, window_size=c.window)
    ref, _ = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    want = torch.autograd.grad(ref, (q, k, v), dout, retain_graph=True)
    base = torch.autograd.grad(pt, (q, k, v), dout)
    for name, g, r, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want, base):
        assert_close_rule(f"{c.id} {name}", g, r, b, factor=GRAD_FACTOR)


ROW_STATS_CASES = FUSED_CASES[:7] + [Case(113, 203, d=256), Case(300, 300, d=256, h=4, h_k=2,
                                                                  window=(50, 20))]


@needs_sm90
@pytest.mark.parametrize("form", ["auto", "after", "first", "lag", "alt", "segments", "two-kernel",
                                  "global-loads"])
@pytest.mark.parametrize("c", ROW_STATS_CASES, ids=lambda c: "sm90-bwd-rowstats-" + c.id)
def test_sm90_bwd_row_stats(c: Case, form, monkeypatch):
    """The dK/dV kernels with the rows' LSE and delta staged in shared memory by the producer
    (the default, IOATTN_SM90_BWD_ROW_STATS), in the fused form in each dQ order (and with the
    masked / unmasked step loops) and the two-kernel one (d=256: its column-split kernel), and
    the global-load form (IOATTN_SM90_BWD_ROW_STATS=0), against the reference's gradients;
    varlen with ragged lengths too."""
    from ioattn.dense import sm90_bwd

    if c.d == 256 and form not in ("auto", "global-loads"):
        pytest.skip("d=256 has one form (column-split dK/dV, then the dQ kernel)")
    if form == "alt" and c.d != 64:
        pytest.skip("one partial a step in turn: d=64 only")
    monkeypatch.setattr(sm90_bwd, "ROW_STATS", form != "global-loads")
    monkeypatch.setattr(sm90_bwd, "FUSED", form != "two-kernel")
    # the step loops as "auto" picks them, or forced on (segments) / off (the other forms)
    monkeypatch.setattr(sm90_bwd, "SEGMENTS", {"auto": "auto", "segments": "1"}.get(form, "0"))
    if form in sm90_bwd.DQ_ORDERS:
        _bwd_order(monkeypatch, form)
    _check_sm90_grads(c, varlen=True)


@needs_sm90
@pytest.mark.parametrize("stages", ["3", "4"])
@pytest.mark.parametrize("form", ["auto", "lag", "two-kernel"])
@pytest.mark.parametrize("c", [c for c in ROW_STATS_CASES if c.d == 64],
                         ids=lambda c: "sm90-bwd-stages-" + c.id)
def test_sm90_bwd_stages(c: Case, form, stages, monkeypatch):
    """The d=64 dK/dV kernel on a deeper Q/dO ring (IOATTN_SM90_BWD_STAGES 3 / 4; the ring's
    phases, the row stats' slots and the TMA-store epilogue's stage all follow the count),
    fused (as auto picks its order, and "lag") and two-kernel, batched and varlen."""
    from ioattn.dense import sm90_bwd

    monkeypatch.setattr(sm90_bwd, "STAGES_MODE", stages)
    monkeypatch.setattr(sm90_bwd, "ROWS_MODE", "64")  # (the 128-row steps fit 2 stages)
    monkeypatch.setattr(sm90_bwd, "FUSED", form != "two-kernel")
    if form in sm90_bwd.DQ_ORDERS:
        _bwd_order(monkeypatch, form)
    _check_sm90_grads(c, varlen=True)


ROWS_CASES = [Case(113, 203, d=64), Case(777, 777, d=64, h=4, h_k=1),
              Case(1000, 100, d=64, causal=True), Case(100, 1000, d=64, causal=True),
              Case(300, 300, d=64, h=4, h_k=2, window=(50, 20)),
              Case(1023, 1000, d=64, b=2, h=2, causal=True, dtype=FP16),
              Case(40, 300, d=64, h=2),  # one 128-row step a key block
              Case(2048, 2048, d=64, b=1, h=4), Case(257, 700, d=64, softcap=30.0)]


@needs_sm90
@pytest.mark.parametrize("form", ["after", "first", "segments"])
@pytest.mark.parametrize("c", ROWS_CASES, ids=lambda c: "sm90-bwd-rows128-" + c.id)
def test_sm90_bwd_rows128(c: Case, form, monkeypatch):
    """(the default, IOATTN_SM90_BWD_ROWS) the fused d=64 dK/dV kernel on 128-row steps: Sᵀ / dPᵀ
    over 128 query rows, each warpgroup's dQ partial half of the rows, with dQ after or before
    dK's update and the masked / unmasked step loops forced on; partial last steps, GQA,
    causal with more / fewer queries than keys, a window, softcap, batched and varlen."""
    from ioattn.dense import sm90_bwd

    monkeypatch.setattr(sm90_bwd, "ROWS_MODE", "128")
    monkeypatch.setattr(sm90_bwd, "SEGMENTS", "1" if form == "segments" else "0")
    _bwd_order(monkeypatch, "first" if form == "first" else "after")
    if c.softcap:  # (batched: the varlen check takes no softcap)
        _fwd_bwd(c, True)
    else:
        _check_sm90_grads(c, varlen=True)


def test_bwd_rows_rule(monkeypatch):
    """128-row steps in the fused form at d = 64 only (by default, or asked for), in the after /
    first orders (alt and lag, which the 64-row steps take, become after); 64-row steps there
    where asked for."""
    from ioattn.dense import sm90_bwd

    assert [sm90_bwd.step_rows(d, True) for d in (64, 128, 256)] == [128, 64, 64]  # default
    monkeypatch.setattr(sm90_bwd, "ROWS_MODE", "64")
    assert sm90_bwd.step_rows(64, True) == 64
    monkeypatch.setattr(sm90_bwd, "ROWS_MODE", "128")
    assert [sm90_bwd.step_rows(d, True) for d in (64, 128, 256)] == [128, 64, 64]
    assert sm90_bwd.step_rows(64, False) == 64  # the two-kernel form
    monkeypatch.setattr(sm90_bwd, "DQ_ORDER", "auto")
    assert sm90_bwd.dq_order(64, False) == "alt"
    assert sm90_bwd.dq_order(64, False, 128) == "after"
    monkeypatch.setattr(sm90_bwd, "DQ_ORDER", "first")
    assert sm90_bwd.dq_order(64, True, 128) == "first"
    monkeypatch.setattr(sm90_bwd, "ROWS_MODE", "96")
    with pytest.raises(ValueError, match="IOATTN_SM90_BWD_ROWS"):
        sm90_bwd.step_rows(64, True)


def test_bwd_stages_rule(monkeypatch):
    from ioattn.dense import sm90_bwd

    monkeypatch.setattr(sm90_bwd, "STAGES_MODE", "3")
    assert (sm90_bwd.dkdv_stages(64), sm90_bwd.dkdv_stages(128)) == (3, 2)
    monkeypatch.setattr(sm90_bwd, "STAGES_MODE", "auto")
    assert sm90_bwd.dkdv_stages(64) == 2
    monkeypatch.setattr(sm90_bwd, "STAGES_MODE", "5")
    with pytest.raises(ValueError, match="IOATTN_SM90_BWD_STAGES"):
        sm90_bwd.dkdv_stages(64)
    monkeypatch.setattr(sm90_bwd, "STAGES_MODE", "3")  # 128-row steps: 2 stages fit
    with pytest.raises(ValueError, match="IOATTN_SM90_BWD_ROWS=64"):
        sm90_bwd.dkdv_stages(64, 128)
    monkeypatch.setattr(sm90_bwd, "STAGES_MODE", "2")
    assert sm90_bwd.dkdv_stages(64, 128) == 2


def _check_sm90_grads(c: Case, varlen: bool) -> None:
    """Gradients through backend='sm90' against the reference, for the case batched and (varlen)
    packed with ragged lengths (b=3, zero-length sequences included)."""
    q, k, v = _inputs(c, "cuda")
    kw = dict(causal=c.causal, window_size=c.window)
    out = ioattn.flash_attn_func(q, k, v, backend="sm90", **kw)
    ref, _ = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    _check_grads(c.id, out, ref, pt, torch.randn_like(out), (q, k, v))
    if varlen:
        cv = Case(0, 0, d=c.d, b=3, h=c.h, h_k=c.h_k, causal=c.causal, window=c.window,
                  dtype=c.dtype)
        q, k, v, lq, lk = _varlen_inputs(cv, "cuda")
        cq, ck = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
        out = ioattn.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), backend="sm90", **kw)
        ref, _ = attention_varlen_ref(q, k, v, cq, ck, **kw)
        pt, _ = attention_varlen_ref(q, k, v, cq, ck, upcast=False, **kw)
        _check_grads(cv.id, out, ref, pt, torch.randn_like(out), (q, k, v))


D256_CASES = [Case(113, 203, d=256), Case(203, 113, d=256, causal=True),
              Case(1024, 1023, d=256, causal=True, b=1, h=2, dtype=FP16),
              Case(300, 300, d=256, h=4, h_k=2, window=(50, 20)),
              Case(777, 777, d=256, h=6, h_k=3, window=(100, -1)),
              Case(40, 300, d=256, h=2), Case(1000, 100, d=256, causal=True),
              Case(512, 512, d=256, causal=True, h=2)]  # (varlen causal too)


@needs_sm90
@pytest.mark.parametrize("c", D256_CASES, ids=lambda c: "sm90-bwd-d256-" + c.id)
def test_sm90_bwd_d256(c: Case, monkeypatch):
    """The d=256 backward (the default; IOATTN_SM90_BWD_D256=0 turns it off): the column-split
    dK/dV kernel (64 keys per CTA, Pᵀ and dSᵀ exchanged between the two warpgroups through shared
    memory) and the dQ kernel on 32-key tiles, against the reference's gradients; batched and
    varlen."""
    from ioattn.dense import sm90_bwd

    monkeypatch.setattr(sm90_bwd, "SUPPORTED_HEAD_DIMS", (64, 128, 256))
    _check_sm90_grads(c, varlen=c.s_q == c.s_k)  # (varlen: the same case packed, ragged)


@needs_sm90
def test_sm90_bwd_dispatch(monkeypatch):
    """auto takes the sm90 backward where preferred, explicit sm90 raises where it has none, and a
    dout that TMA cannot read (a transposed view) is copied, not refused."""
    from ioattn.dense import sm90_bwd

    monkeypatch.setattr(sm90_bwd, "SUPPORTED_HEAD_DIMS", (64, 128))  # as IOATTN_SM90_BWD_D256=0
    calls = []
    orig = sm90_bwd.attn_bwd_sm90
    monkeypatch.setattr(sm90_bwd, "attn_bwd_sm90",
                        lambda *a_, **kw: calls.append(1) or orig(*a_, **kw))
    c = Case(2048, 2048, d=128, b=1, h=2)
    q, k, v = _inputs(c, "cuda")
    out = ioattn.flash_attn_func(q, k, v)
    dout = torch.randn(1, 2, 2048, 128, device="cuda", dtype=q.dtype).transpose(1, 2)
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert calls, "backend='auto' should run the sm90 backward at d=128, s=2k, non-causal"
    want = torch.autograd.grad(ioattn.flash_attn_func(q, k, v, backend="triton"),
                               (q, k, v), dout)
    for g, w in zip(got, want):
        assert (g.float() - w.float()).abs().max().item() <= 2e-2 * w.float().abs().max().item()
    q, k, v = _inputs(Case(64, 64, d=256, b=1, h=2), "cuda")
    with pytest.raises(ValueError, match="backward"):
        ioattn.flash_attn_func(q, k, v, backend="sm90")
    with torch.no_grad():
        ioattn.flash_attn_func(q, k, v, backend="sm90")  # no gradient needed: runs


def _bwd_order(monkeypatch, order: str) -> None:
    """The fused backward's dQ order (``sm90_bwd.DQ_ORDER``): auto, after, first, lag, alt; lag
    and alt on 64-row steps (``ROWS_MODE`` 64: the default 128-row steps at d = 64 take after
    in their place)."""
    from ioattn.dense import sm90_bwd

    monkeypatch.setattr(sm90_bwd, "DQ_ORDER", order)
    if order in ("lag", "alt"):
        monkeypatch.setattr(sm90_bwd, "ROWS_MODE", "64")


@needs_sm90
@pytest.mark.parametrize("order", ["auto", "after", "first", "lag", "alt"])
@pytest.mark.parametrize("c", [Case(0, 0, d=128, b=5, causal=True, h=6, h_k=2),
                               Case(0, 0, d=64, b=4, window=(30, 3), dtype=FP16),
                               Case(0, 0, d=256, b=3, causal=True)],
                         ids=lambda c: "sm90-varlen-" + c.id)
def test_sm90_varlen(c: Case, order, monkeypatch):
    """Varlen through the sm90 kernels (forward; backward where covered, in each dQ order)."""
    if order != "auto" and (not _covers_bwd(c) or (order == "alt" and c.d != 64)):
        pytest.skip("the dQ order applies to the covered backward (alt: d=64)")
    _bwd_order(monkeypatch, order)
    q, k, v, lq, lk = _varlen_inputs(c, "cuda")
    cq, ck = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
    kw = dict(causal=c.causal, window_size=c.window)
    args = (q, k, v) if _covers_bwd(c) else (q.detach(), k.detach(), v.detach())
    out, lse, _ = ioattn.flash_attn_varlen_func(*args, cq, ck, max(lq), max(lk),
                                                return_attn_probs=True, backend="sm90", **kw)
    ref, lse_ref = attention_varlen_ref(q, k, v, cq, ck, **kw)
    pt, _ = attention_varlen_ref(q, k, v, cq, ck, upcast=False, **kw)
    _check_fwd(c, out, lse, ref, lse_ref, pt)
    if _covers_bwd(c):
        _check_grads(c.id, out, ref, pt, torch.randn_like(out), (q, k, v))


@needs_sm90
def test_sm90_matches_triton_and_auto_picks_it(monkeypatch):
    q, k, v = (torch.randn(1, 2048, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    a = ioattn.flash_attn_func(q, k, v, backend="sm90")
    b = ioattn.flash_attn_func(q, k, v, backend="triton")
    assert (a.float() - b.float()).abs().max().item() < 2e-2
    from ioattn.dense import sm90_fwd

    calls = []
    orig = sm90_fwd.attn_fwd_sm90
    monkeypatch.setattr(sm90_fwd, "attn_fwd_sm90",
                        lambda *a_, **kw: calls.append(1) or orig(*a_, **kw))
    ioattn.flash_attn_func(q, k, v)
    assert calls, "backend='auto' should run the sm90 forward here (d=128, non-causal, s=2k)"
    if os.environ.get("IOATTN_TEST_SM90") != "always":  # that run prefers sm90 everywhere
        calls.clear()
        # d=64 causal at 1k: the portable kernel is auto's choice (sm90_fwd.preferred)
        q, k, v = (t[:, :1024, :, :64].contiguous() for t in (q, k, v))
        ioattn.flash_attn_func(q, k, v, causal=True)
        assert not calls


@needs_sm90
@pytest.mark.parametrize("kw", [dict(softcap=2.0, grad=True, d=256), dict(dropout_p=0.1),
                                dict(d=80), dict(strided=True)])
def test_sm90_refuses_what_it_does_not_cover(kw):
    """(softcap: the sm90 forward takes it, the sm90 backward at d in {64, 128})"""
    d = kw.pop("d", 64)
    grad = kw.pop("grad", False)
    q, k, v = (torch.randn(1, 64, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
               for _ in range(3))
    if kw.pop("strided", False):  # heads not packed within a row: no TMA view
        q = torch.randn(1, 64, d, 4, device="cuda", dtype=torch.bfloat16).transpose(2, 3)
    with pytest.raises(ValueError, match="sm90"):
        ioattn.flash_attn_func(q, k, v, backend="sm90", **kw)
    ioattn.flash_attn_func(q, k, v, **kw)  # auto runs it on the portable kernels


SOFTCAP_CASES = [Case(113, 203, d=64, softcap=2.0),
                 Case(203, 113, d=128, causal=True, softcap=5.0),
                 Case(1023, 1024, d=128, causal=True, softcap=30.0, dtype=FP16),
                 Case(4133, 4133, d=64, causal=True, b=1, h=2, h_k=1, softcap=50.0),
                 Case(2048, 2048, d=64, b=1, h=2, softcap=3.0),
                 Case(777, 777, d=128, h=6, h_k=3, window=(100, -1), softcap=10.0),
                 Case(300, 300, d=256, h=4, h_k=2, window=(50, 20), softcap=4.0)]


@needs_sm90
@pytest.mark.parametrize("c", SOFTCAP_CASES, ids=lambda c: "sm90-softcap-" + c.id)
def test_sm90_softcap_fwd(c: Case):
    """Softcap (cap * tanh(scores / cap)) in the sm90 forward, as launched: persistent batched
    forms at d=64 / 128 (the d=64 192x128 tiles at 2k non-causal and 4k causal), one CTA a
    tile at d=256 and varlen (the same rows packed, equal lengths)."""
    _matches_varlen(c, *_forward_only(c))


SOFTCAP_BWD_CASES = [Case(113, 203, d=64, softcap=2.0),
                     Case(203, 113, d=128, causal=True, softcap=5.0),
                     Case(1023, 1024, d=128, causal=True, softcap=30.0, dtype=FP16, b=1),
                     Case(777, 777, d=64, h=6, h_k=3, window=(100, -1), softcap=10.0, b=1),
                     Case(300, 300, d=128, h=4, h_k=2, window=(50, 20), softcap=4.0)]


@needs_sm90
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "two-kernel"])
@pytest.mark.parametrize("c", SOFTCAP_BWD_CASES, ids=lambda c: "sm90-softcap-bwd-" + c.id)
def test_sm90_softcap_fwd_bwd(c: Case, deterministic):
    """Softcap through the sm90 backward (d in {64, 128}): tanh on Sᵀ, dS = P (dP - delta)
    (1 - tanh²) with 1 - tanh² recovered from P in the dK/dV kernels (fused with dQ's TMA
    reductions, or the two-kernel deterministic form and its dQ kernel); every gradient
    checked (and the output's LSE)."""
    _fwd_bwd(c, True, deterministic)


@needs_sm90
def test_sm90_misaligned_base_is_copied():
    """Inputs that start mid-row (a base 8 bytes past alignment) run on the sm90 kernels
    through one copy: TMA needs 16-byte bases, and the check cannot run while torch.compile
    traces the dispatch, so the op mends it at launch."""
    c = Case(203, 203, d=64, causal=True, h=2)
    q, k, v = (torch.randn(t.numel() + 4, device="cuda", dtype=t.dtype)[4:].view(t.shape)
               .copy_(t).requires_grad_() for t in (x.detach() for x in _inputs(c, "cuda")))
    assert all(t.data_ptr() % 16 for t in (q, k, v))
    out = ioattn.flash_attn_func(q, k, v, causal=True, backend="sm90")
    ref, _ = attention_ref(q, k, v, causal=True)
    pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert_close_rule("out", out, ref, pt)
    _check_grads(c.id, out, ref, pt, torch.randn_like(out), (q, k, v))


def test_sm90_padded_head_dims_rule(monkeypatch):
    """(d, d_v) = (96, 96), (192, 192) and (192, 128) are covered (read in place or through
    zero-padded copies: any layout, an unviewable one is made contiguous), backward too (192 as
    256: not with softcap); the paged forward refuses them; 'auto' takes them where they were
    timed faster, in each padding mode; other head dims are refused by name."""
    from ioattn.dense import sm90_bwd, sm90_common, sm90_fwd

    def t(d, transpose=False):
        x = torch.randn(1, 8, 4, d, dtype=torch.bfloat16)
        return x.transpose(1, 2) if transpose else x  # heads not packed in a row: copied anyway

    for d, d_v in ((96, 96), (192, 192), (192, 128)):
        q, v = t(d, True), t(d_v, True)
        assert sm90_fwd.unsupported_reason(q, q, v, d, d_v, 0.0, False, 0.0, False) is None
        assert sm90_bwd.unsupported_reason(d, d_v, 0.0, False, 0.0) is None
        # copies: from 8k queries (96, 192), the backward from 2k keys at 192 and 8k at 96;
        # (192, 128) and softcap not timed
        monkeypatch.setattr(sm90_common, "PAD_MODE", "copy")
        timed = d == d_v
        assert sm90_fwd.preferred(d, False, 8192, 8192, head_dim_v=d_v) == timed
        assert not sm90_fwd.preferred(d, False, 4096, 8192, head_dim_v=d_v)
        assert not sm90_fwd.preferred(d, False, 8192, 8192, False, 30.0, d_v)
        assert sm90_bwd.preferred(d, False, 8192, head_dim_v=d_v) == timed
        assert sm90_bwd.preferred(d, False, 2048, head_dim_v=d_v) == (timed and d == 192)
        assert not sm90_bwd.preferred(d, False, 8192, 30.0, d_v)
        # in place (the default): from 1k queries / keys
        monkeypatch.setattr(sm90_common, "PAD_MODE", "tma")
        for masked in (False, True):
            assert sm90_fwd.preferred(d, masked, 1024, 1024, head_dim_v=d_v)
            assert not sm90_fwd.preferred(d, masked, 512, 8192, head_dim_v=d_v)
            assert not sm90_fwd.preferred(d, masked, 8192, 8192, False, 30.0, d_v)
            assert sm90_bwd.preferred(d, masked, 1024, head_dim_v=d_v)
            assert not sm90_bwd.preferred(d, masked, 512, head_dim_v=d_v)
            assert not sm90_bwd.preferred(d, masked, 8192, 30.0, d_v)
        bt = torch.zeros(1, 4, dtype=torch.int32)
        k_cache = torch.randn(4, 16, 4, d, dtype=torch.bfloat16)
        v_cache = torch.randn(4, 16, 4, d_v, dtype=torch.bfloat16)
        assert "in place" in sm90_fwd.paged_unsupported_reason(q, k_cache, v_cache, bt, 0.0,
                                                               False, False, False)
    assert sm90_bwd.unsupported_reason(96, 96, 2.0, False, 0.0) is None
    assert "d=192" in sm90_bwd.unsupported_reason(192, 192, 2.0, False, 0.0)
    q = t(80)
    assert "96" in sm90_fwd.unsupported_reason(q, q, q, 80, 80, 0.0, False, 0.0, False)
    q = t(96)
    assert "d_v" in sm90_fwd.unsupported_reason(q, q, t(64), 96, 64, 0.0, False, 0.0, False)
    assert sm90_bwd.unsupported_reason(96, 64, 0.0, False, 0.0) is not None


LPT_CASES = [Case(1024, 1024, d=128, b=4, h=8, causal=True),
             Case(1024, 1024, d=64, b=4, h=16, causal=True),  # four groups, 512 tiles
             Case(777, 1023, d=64, b=3, h=6, h_k=2, causal=True, dtype=FP16),
             Case(1000, 1000, d=128, b=5, h=3, window=(100, 20)),
             Case(512, 512, d=256, b=3, h=4, causal=True),
             Case(640, 640, d=96, b=2, h=6, causal=True)]


@needs_sm90
@pytest.mark.parametrize("c", LPT_CASES, ids=lambda c: "sm90-lpt-" + c.id)
def test_sm90_grouped_heaviest_first(c: Case, monkeypatch):
    """IOATTN_SM90_FWD_LPT / _BWD_LPT (on by default; the backward under masks only): the
    forward's tile counter (or its grid, one CTA per tile) and the backward's dK/dV (and dQ)
    grids take their blocks in grouped heaviest-first order (heads in groups of a divisor of
    their count, GQA and odd head counts included); every output, LSE and gradient against the
    reference (outputs poisoned before the launch: a block the order skipped shows), and the
    order was really grouped."""
    from ioattn.dense import sm90_bwd, sm90_common, sm90_fwd

    monkeypatch.setattr(sm90_fwd, "LPT", True)
    monkeypatch.setattr(sm90_bwd, "LPT", True)
    groups = {}  # per direction: the head groups its launches took
    size = sm90_common.head_group_size
    for mod in (sm90_fwd, sm90_bwd):
        monkeypatch.setattr(mod, "head_group_size", lambda *a, m=mod.__name__: groups.setdefault(
            m, []).append(size(*a)) or groups[m][-1])
    _fwd_bwd(c, _covers_bwd(c))
    _matches_varlen(c, *_forward_only(c))  # (equal lengths: varlen's grid, one CTA per tile)
    # (d=256: the one-CTA-per-tile forward's grid, the backward's dK/dV and dQ grids)
    assert set(groups) == {sm90_fwd.__name__, sm90_bwd.__name__}, groups
    assert all(min(g) > 1 for g in groups.values()), groups


def test_head_group_size():
    """About one wave of blocks a group, a divisor of the head count (1 where none fits)."""
    from ioattn.dense.sm90_common import head_group_size

    assert head_group_size(128, 16, 132) == 8
    assert head_group_size(64, 32, 132) == 4
    assert head_group_size(16, 128, 132) == 1
    assert head_group_size(15, 16, 132) == 5  # (8 does not divide 15)
    assert head_group_size(7, 4, 132) == 7
    assert head_group_size(13, 16, 132) == 1


def test_narrow_dv():
    """IOATTN_SM90_PAD_NARROW's V / O tile width: d_v padded to a power of two, or d_v itself
    (None) where it is one."""
    from ioattn.dense.sm90_common import narrow_dv

    assert narrow_dv(96) == 128 and narrow_dv(192) == 256
    assert narrow_dv(128) is None and narrow_dv(64) is None and narrow_dv(256) is None


def test_bwd_order_groups_masked_grids_only(monkeypatch):
    """The backward's grids take the grouped order under a causal / local mask only (without
    one every block costs the same, and grouping timed 1% slower)."""
    from ioattn.dense import sm90_bwd
    from ioattn.dense.params import AttnParams

    def params(left, right):
        return AttnParams(8, 2048, 2048, 128, 128, 0.1, left, right, 0.0, 0.0, None, None, None,
                          None, 0)

    monkeypatch.setattr(sm90_bwd, "sm_count", lambda device: 132)
    monkeypatch.setattr(sm90_bwd, "LPT", True)
    grid, cpu = (16, 128), torch.device("cpu")
    assert sm90_bwd._order(grid, params(-1, 0), cpu) == 8  # causal
    assert sm90_bwd._order(grid, params(100, 20), cpu) == 8  # a window
    assert sm90_bwd._order(grid, params(-1, -1), cpu) == 1  # no mask
    monkeypatch.setattr(sm90_bwd, "LPT", False)
    assert sm90_bwd._order(grid, params(-1, 0), cpu) == 1


def test_rows_view_of_layouts():
    """Which layouts the sm90 kernels' TMA reads as [rows, heads * d] in place: heads packed in
    a row and batches back to back; a single head's stride never matters (the transpose of a
    [b, 1, s, d] tensor, MQA's K/V in torch's layout, is rows of d)."""
    from ioattn.dense.sm90_common import rows_view, tma_view_problem

    assert rows_view(torch.empty(2, 50, 4, 96), False) == (100, 384)
    assert rows_view(torch.empty(2, 4, 50, 96).transpose(1, 2), False) is None
    assert rows_view(torch.empty(2, 1, 50, 96).transpose(1, 2), False) == (100, 96)
    assert rows_view(torch.empty(1, 50, 4, 96)[:, :, :2], False) == (50, 384)
    assert rows_view(torch.empty(2, 50, 4, 96)[:, :20], False) is None  # batches apart
    assert rows_view(torch.empty(70, 1, 8)[::2], True) == (35, 16)
    assert "16 bytes" in tma_view_problem("k", torch.empty(3, 5, 1, 4, dtype=torch.bfloat16), False)


def test_loop_spills_reads_sass():
    """inspect.loop_spills: the innermost backward-branch spans that issue HGMMA, QGMMA or HMMA,
    with their instructions and spill stores / loads an iteration; outer loops and loops without
    tensor-core MMAs are not reported."""
    from ioattn.dense.inspect import loop_spills

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   STL [R1], R2 ;",  # (outside every loop)
        "        /*0020*/                   HGMMA.64x64x16.F32 R24, gdesc[UR4], R24 ;",
        "        /*0030*/                   LDL R3, [R1] ;",
        "        /*0040*/              @P0   BRA 0x20 ;",  # inner loop 0x20-0x40
        "        /*0050*/                   FADD R4, R4, R5 ;",
        "        /*0060*/              @P1   BRA 0x50 ;",  # a loop without wgmma
        "        /*0070*/              @P2   BRA 0x10 ;",  # outer loop
        "        /*0080*/                   HMMA.16816.F32.BF16 R8, R4, R6, RZ ;",
        "        /*0090*/                   STL [R1], R8 ;",
        "        /*00a0*/              @P3   BRA 0x80 ;",  # an mma.sync loop
        "        /*00b0*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;",
        "        /*00c0*/              @P4   BRA 0xb0 ;",  # an fp8 wgmma loop
        "        /*00d0*/                   EXIT ;"])
    assert loop_spills(sass) == [[3, 0, 1], [3, 1, 0], [2, 0, 0]]


def test_timeline_stamps_match_the_kernels():
    """benchmarks/timeline.py's stamped copies of the sm90 backward and forward modules build:
    each anchor it patches occurs once in the kernels' source (it raises otherwise), so a
    kernel change that moves or repeats one shows here, not on the GPU."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "timeline.py"
    spec = importlib.util.spec_from_file_location("ioattn_timeline", path)
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    assert "_tl_c1()" in timeline.bwd_source(0) and "_tl_f1(t)" in timeline.fwd_source(0)
    # the launched / stamped forms' registers and spills, read from Triton 3.6's per-device
    # caches ((kernel cache, key cache, target, backend, binder) a device)
    from types import SimpleNamespace

    from ioattn.dense import sm90_fwd

    assert hasattr(sm90_fwd._attn_fwd_sm90, "device_caches")
    fake = SimpleNamespace(device_caches={0: ({"key": SimpleNamespace(n_regs=168, n_spills=20)},
                                              {}, None, None, None)})
    assert timeline.compiled_forms(fake) == [{"regs": 168, "local_bytes": 20}]
    # the forward's stamps a tile: each warpgroup's start, last P·V, stored, Q arrived, first
    # block done (FWD_WG apart), then the SM id; a tile without key blocks has no Q / first
    # block stamps (its q_wait / first are left out of the medians)
    w = timeline.FWD_WG
    rows = torch.zeros(3, timeline.FWD_SLOTS, dtype=torch.int64)
    for i, (t0, n) in enumerate(((1000, 8), (20000, 8), (40000, 0))):
        for wg in (0, 1):
            start, q, first, pv, stored = t0, t0 + 500, t0 + 1500, t0 + n * 1000, t0 + n * 1000
            stored += 300
            rows[i, wg * w:(wg + 1) * w] = torch.tensor(
                [start, pv, stored, q if n else 0, first if n else 0])
        rows[i, 2 * w] = 7  # SM id
    out = timeline.summarize_fwd(rows)
    assert out["tiles"] == 3 and out["per_sm"] == {"min": 3, "max": 3, "sms": 1}, out
    assert out["wg0_us"] == out["wg1_us"] == {"compute": 8.0, "q_wait": 0.5, "first": 1.0,
                                                 "store": 0.3}, out


def test_sm90_tma_epilogue_rules(monkeypatch):
    """Where the kernels store their outputs by TMA: the backward's dK / dV where they form
    16-byte aligned [rows, heads * d] matrices (IOATTN_SM90_BWD_TMA_STORE); the persistent
    forward's O (IOATTN_SM90_FWD_O_TMA) where the last V stage holds every consumer
    warpgroup's 64 rows, O is not a head dim read in place and there is more than one key."""
    from ioattn.dense import sm90_bwd, sm90_fwd

    writable = sm90_bwd._tma_writable
    assert writable(torch.empty(2, 50, 4, 64, dtype=torch.bfloat16), False)
    assert not writable(torch.empty(2, 4, 50, 64, dtype=torch.bfloat16).transpose(1, 2), False)
    assert not writable(torch.empty(2, 50, 4, 64, dtype=torch.bfloat16)[:, :, :, :36], False)
    assert writable(torch.empty(300, 4, 128, dtype=torch.float16), True)
    monkeypatch.setattr(sm90_fwd, "O_TMA", True)
    monkeypatch.setattr(sm90_fwd, "Q_BUFS", "1")
    monkeypatch.setattr(sm90_fwd, "PERSISTENT_MODE", "auto")
    monkeypatch.setattr(sm90_fwd, "WG3", True)
    monkeypatch.setattr(sm90_fwd, "WG3_BLOCK_N", "auto")
    form = sm90_fwd.launch_form
    assert sm90_fwd._o_tma(form(128, False, "none", 8192), None, 8192) == 2  # O_DEFER
    assert sm90_fwd._o_tma(form(64, False, "causal", 2048), None, 2048)  # two warpgroups
    assert not sm90_fwd._o_tma(form(64, False, "none", 8192), None, 8192)  # 192 rows, 128 keys
    assert not sm90_fwd._o_tma(form(128, True, "causal", 8192), None, 8192)  # varlen
    assert not sm90_fwd._o_tma(form(128, False, "none", 8192), 128, 8192)  # d = 96 in place
    # one key: Triton folds seqlen_k = 1 into the kernel, and that form fails to compile
    assert not sm90_fwd._o_tma(form(64, False, "none", 1), None, 1)
    monkeypatch.setattr(sm90_fwd, "Q_BUFS", "2")  # O in the tile's Q buffer, the 192-row too
    assert sm90_fwd._o_tma(form(64, False, "none", 8192), None, 8192) == 3
    assert sm90_fwd._o_tma(form(128, False, "none", 8192), None, 8192) == 3
    assert not sm90_fwd._o_tma(form(128, False, "none", 8192), 128, 8192)  # d = 96 in place
    monkeypatch.setattr(sm90_fwd, "Q_BUFS", "1")
    monkeypatch.setattr(sm90_fwd, "O_DEFER", False)
    assert sm90_fwd._o_tma(form(128, False, "none", 8192), None, 8192) == 1
    monkeypatch.setattr(sm90_fwd, "O_TMA", False)
    assert not sm90_fwd._o_tma(form(128, False, "none", 8192), None, 8192)


@pytest.mark.parametrize("d,d_v", [(96, 96), (192, 192), (192, 128)])
def test_sm90_padded_head_dims_host_side(d, d_v, device, monkeypatch):
    """The op's side of the zero padding, anywhere: with the portable kernels standing in for
    the sm90 launchers (same arguments), impl='sm90' pads q, k, v (and dO, O) to 128 / 256,
    keeps the caller's 1/sqrt(d) and cuts outputs and gradients back to d columns."""
    import math

    from ioattn.dense import op, sm90_bwd, sm90_common, sm90_fwd
    from ioattn.dense.triton_bwd import attn_bwd
    from ioattn.dense.triton_fwd import attn_fwd

    monkeypatch.setattr(sm90_common, "PAD_MODE", "copy")
    seen = []
    monkeypatch.setattr(sm90_fwd, "attn_fwd_sm90",
                        lambda p, q, *a: seen.append(q.shape[-1]) or attn_fwd(p, q, *a))
    monkeypatch.setattr(sm90_bwd, "attn_bwd_sm90",  # (the portable kernel: not the sm90 key)
                        lambda p, dout, *a, fused: seen.append(dout.shape[-1])
                        or attn_bwd(p, dout, *a[:10]))
    c = Case(33, 47, d=d, d_v=d_v, b=1, h=2, causal=True)
    q, k, v = _inputs(c, device)
    scale = 1.0 / math.sqrt(d)
    args = (None, None, c.s_q, c.s_k, scale, -1, 0, 0.0, None, 0.0, None)
    out, lse = op.fwd_impl(q.detach(), k.detach(), v.detach(), *args, impl="sm90")
    ref, lse_ref = attention_ref(q, k, v, causal=True)
    pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert out.shape == q.shape[:-1] + (d_v,) and out.is_contiguous()
    assert_close_rule("out", out, ref, pt)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)
    dout = torch.randn_like(out)
    grads = op.bwd_impl(dout, q.detach(), k.detach(), v.detach(), out, lse, None, *args,
                        impl="sm90")
    want = torch.autograd.grad(ref, (q, k, v), dout)
    base = torch.autograd.grad(pt, (q, k, v), dout)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, want, base):
        assert g.shape == r.shape
        assert_close_rule(name, g, r, b, factor=GRAD_FACTOR)
    assert seen == [sm90_fwd.PADDED_HEAD_DIMS[(d, d_v)]] * 2


@pytest.mark.parametrize("d,d_v", [(96, 96), (192, 128)])
def test_sm90_padded_in_place_host_side(d, d_v, device, monkeypatch):
    """IOATTN_SM90_PAD=tma: the op hands the sm90 forward and backward q, k, v (and dO) as they
    are (a layout TMA cannot view is made contiguous, nothing padded), and the launchers'
    descriptors view them as [rows, heads, d] with [rows, 1, 128 / 256] boxes (portable kernels
    stand in for the launchers)."""
    import math

    from ioattn.dense import op, sm90_bwd, sm90_common, sm90_fwd
    from ioattn.dense.triton_bwd import attn_bwd
    from ioattn.dense.triton_fwd import attn_fwd

    monkeypatch.setattr(sm90_common, "PAD_MODE", "tma")
    seen = []

    def fwd(p, q, k, v, *a):
        seen.append((q.shape[-1], v.shape[-1], q.is_contiguous(), k.is_contiguous()))
        return attn_fwd(p, q, k, v, *a)

    monkeypatch.setattr(sm90_fwd, "attn_fwd_sm90", fwd)
    monkeypatch.setattr(sm90_bwd, "attn_bwd_sm90",  # (the portable kernel: not the sm90 key)
                        lambda p, dout, *a, fused: seen.append(dout.shape[-1])
                        or attn_bwd(p, dout, *a[:10]))
    c = Case(33, 47, d=d, d_v=d_v, b=2, h=2, causal=True)
    q, k, v = _inputs(c, device)
    kt = k.detach().transpose(1, 2).contiguous().transpose(1, 2)  # heads not packed in a row
    scale = 1.0 / math.sqrt(d)
    args = (None, None, c.s_q, c.s_k, scale, -1, 0, 0.0, None, 0.0, None)
    out, lse = op.fwd_impl(q.detach(), kt, v.detach(), *args, impl="sm90")
    ref, lse_ref = attention_ref(q, k, v, causal=True)
    pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert out.shape == q.shape[:-1] + (d_v,)
    assert_close_rule("out", out, ref, pt)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)
    dout = torch.randn_like(out)
    grads = op.bwd_impl(dout, q.detach(), kt, v.detach(), out, lse, None, *args, impl="sm90")
    want = torch.autograd.grad(ref, (q, k, v), dout)
    base = torch.autograd.grad(pt, (q, k, v), dout)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, want, base):
        assert g.shape == r.shape
        assert_close_rule(name, g, r, b, factor=GRAD_FACTOR)
    d_pad = sm90_fwd.PADDED_HEAD_DIMS[(d, d_v)]
    assert seen == [(d, d_v, True, True), d_v]
    # the launcher's view of an unpadded operand
    desc = sm90_common.rows_descriptor(q.detach(), False, 64, pad_to=d_pad)
    assert desc.shape == (c.b * c.s_q, c.h, d) and desc.strides == (c.h * d, d, 1)
    assert desc.block_shape == (64, 1, d_pad) and desc.layout.rank == 3
    two = sm90_common.shared_layout(64, d_pad, q.dtype)
    assert desc.layout.swizzle_byte_width == two.swizzle_byte_width
    assert sm90_common.rows_descriptor(q.detach(), False, 64, pad_to=d).block_shape == (64, d)


@needs_sm90
@pytest.mark.parametrize("c", [c for c in CASES if (c.d, c.d_v or c.d) in ((96, 96), (192, 192),
                                                                         (192, 128))],
                         ids=lambda c: "sm90-pad-" + c.id)
@pytest.mark.parametrize("mode", ["tma", "copy", "narrow"])
def test_sm90_padded_in_place(c: Case, mode, monkeypatch):
    """IOATTN_SM90_PAD=tma (the default) with the padded tensor-core work on the H200: the
    forward and backward read q, k, v (dO) of head dim 96 / 192 in place (boxes zero-filled
    past d by the TMA unit; outputs and gradients, poisoned before the launch by the op,
    written only up to their own head dims), checked with the LSE and every gradient; the same
    rows as varlen match; the deterministic backward too. IOATTN_SM90_PAD=copy, the
    zero-padded copies, the same way; "narrow" (IOATTN_SM90_PAD_NARROW=1, the default): the
    forward's QKᵀ over d's own columns in two wgmma groups and V / O at d_v's own width
    ((192, 128): 2D 128-column tiles, O staged in Q's buffer); the dQ kernel's (the
    deterministic d=96 backward's, every d=192 one's) and the column-split dK/dV
    kernel's S and dP over d's and d_v's own columns."""
    from ioattn.dense import sm90_common

    monkeypatch.setattr(sm90_common, "PAD_MODE", "tma" if mode == "narrow" else mode)
    monkeypatch.setattr(sm90_common, "PAD_NARROW", mode == "narrow")
    _fwd_bwd(c, _covers_bwd(c) and c.s_q * c.s_k <= 1024 * 1024)
    _matches_varlen(c, *_forward_only(c))
    if _covers_bwd(c) and c.d == 96:  # (d=192 runs the two-kernel form always)
        _fwd_bwd(c, True, deterministic=True)


@needs_sm90
@pytest.mark.parametrize("d", [96, 192])
def test_sm90_padded_head_dims_varlen(d):
    """The zero-padded head dims through the varlen layout, an empty sequence included, with
    gradients: outputs and gradients come back with d columns."""
    lens = [0, 77, 223]
    cu = cu_seqlens(lens, "cuda")
    q, k, v = (torch.randn(sum(lens), 4, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = ioattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                        backend="sm90")
    assert out.shape == q.shape
    ref, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True)
    pt, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True, upcast=False)
    assert_close_rule("out", out, ref, pt)
    _check_grads(f"varlen d{d}", out, ref, pt, torch.randn_like(out), (q, k, v))


def test_sm90_dispatch_check_traces_under_compile(device):
    """The sm90 coverage check looks at shapes and strides only (no data_ptr), so torch.compile
    traces flash_attn_func's dispatch on Hopper without a graph break."""
    from ioattn.dense.sm90_fwd import unsupported_reason

    q, k, v = (torch.randn(1, 33, 2, 64, device=device, dtype=torch.bfloat16) for _ in range(3))

    def f(q, k, v):
        covered = unsupported_reason(q, k, v, 64, 64, 0.0, False, 0.0, False) is None
        return q * (2.0 if covered else 3.0)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(q, k, v), q * 2.0)


def test_sm90_forward_preference_rule():
    """'auto' takes the sm90 forward where it measured faster: long queries, a chunk of >= 512
    queries over long keys (chunked prefill: 1.3x the portable kernel), and batched problems
    from 512 (d=128, d=256, d=64 without a mask) queries and keys; shorter ones stay
    portable. Pingpong is on by default at d=256 only."""
    from ioattn.dense import sm90_fwd

    if os.environ.get("IOATTN_TEST_SM90") == "always":
        pytest.skip("the forced-sm90 suite replaces the rule (tests/conftest.py)")
    assert sm90_fwd.preferred(128, True, 2048, 2048)
    assert sm90_fwd.preferred(128, True, 2048, 2048, False, 30.0)  # softcap: d in {64, 128}
    assert sm90_fwd.preferred(64, True, 2048, 2048, False, 30.0)
    assert not sm90_fwd.preferred(64, True, 1024, 1024, False, 30.0)
    assert not sm90_fwd.preferred(256, True, 8192, 8192, False, 30.0)  # not timed
    assert sm90_fwd.preferred(128, True, 512, 4608)
    assert not sm90_fwd.preferred(128, True, 256, 4608)
    # batched: from 512 queries and keys at d=128 and d=256 (the FA grid's short cells);
    # varlen and sliding windows from 2k
    if sm90_fwd._persistent(128, False):  # (the d=128 form timed there)
        assert sm90_fwd.preferred(128, False, 1024, 1024)
        assert sm90_fwd.preferred(128, True, 1024, 1024)
        assert sm90_fwd.preferred(128, False, 512, 512)
        assert sm90_fwd.preferred(128, True, 512, 512)
        assert not sm90_fwd.preferred(128, False, 256, 256)
    assert not sm90_fwd.preferred(128, False, 1024, 1024, varlen=True)
    assert not sm90_fwd.preferred(128, True, 1024, 1024, window=True)
    assert not sm90_fwd.preferred(256, True, 512, 512, window=True)
    assert not sm90_fwd.preferred(128, False, 1024, 256)
    assert sm90_fwd.preferred(256, True, 512, 512)
    assert not sm90_fwd.preferred(256, True, 512, 512, varlen=True)
    assert not sm90_fwd.preferred(256, False, 256, 256)
    assert sm90_fwd.preferred(64, False, 8192, 8192)
    if sm90_fwd._persistent(64, False):  # batched non-causal d=64 from 512 (persistent form)
        assert sm90_fwd.preferred(64, False, 512, 512)
        assert sm90_fwd.preferred(64, False, 512, 4608)
        assert not sm90_fwd.preferred(64, False, 256, 4608)
        assert not sm90_fwd.preferred(64, False, 2048, 2048, varlen=True)
        # causal: with two Q buffers (up to Q_BUFS_MAX_SEQLEN_K keys by default)
        assert sm90_fwd.preferred(64, True, 2048, 2048) == sm90_fwd._two_q(64, True, 2048)
        assert not sm90_fwd.preferred(64, True, 1024, 1024)
        assert not sm90_fwd.preferred(64, True, 2048, 2048, varlen=True)
    assert sm90_fwd.preferred(64, True, 4096, 4096) == sm90_fwd.WG3
    if sm90_fwd.PINGPONG == "auto":
        assert [sm90_fwd._pingpong(d, 2) for d in (64, 128, 256)] == [False, False, True]
        assert not sm90_fwd._pingpong(64, 3)


def test_auto_keeps_softcap_directions_in_one_family(monkeypatch):
    """'auto' with softcap takes the sm90 kernels for both directions or for neither (their
    tanh.approx and the portable kernels' exact tanh differ, and a backward recomputes P against
    the forward's LSE); without softcap each direction is picked on its own. Host-side: the
    platform check is stubbed as if on Hopper."""
    from ioattn.dense import api

    if os.environ.get("IOATTN_TEST_SM90") == "always":
        pytest.skip("the forced-sm90 suite replaces the rules (tests/conftest.py)")
    monkeypatch.setattr(api, "sm90_unavailable_reason", lambda device: None)
    monkeypatch.setattr("ioattn.dispatch.sm90_unavailable_reason", lambda device: None)
    # (CPU tensors: the portable kernels' platform check would want the interpreter)
    monkeypatch.setattr("ioattn.dispatch.triton_unavailable_reason", lambda device: None)
    q, k, v = (torch.empty(2, 64, 4, 128, dtype=torch.bfloat16) for _ in range(3))

    def pick(cap, s_q, s_k):
        return api._pick("auto", q, k, v, cap, None, 0.0, False, True, s_q, s_k)

    assert pick(30.0, 4096, 4096) == ("sm90", "sm90")
    assert pick(30.0, 4096, 1024) == ("triton", "triton")  # the backward would stay portable
    assert pick(30.0, 1024, 4096) == ("triton", "triton")  # the forward would
    assert pick(0.0, 4096, 1024) == ("sm90", "triton")  # no softcap: each on its own


def test_auto_short_batched_rules_see_the_call(monkeypatch):
    """The short-cell rules (batched, from 512 / 1k) get what ``_pick`` knows of the call:
    varlen, a sliding window and the query length keep the earlier rules. Host-side, the
    platform check stubbed as if on Hopper."""
    from ioattn.dense import api, sm90_fwd

    if os.environ.get("IOATTN_TEST_SM90") == "always":
        pytest.skip("the forced-sm90 suite replaces the rules (tests/conftest.py)")
    monkeypatch.setattr(api, "sm90_unavailable_reason", lambda device: None)
    monkeypatch.setattr("ioattn.dispatch.sm90_unavailable_reason", lambda device: None)
    monkeypatch.setattr("ioattn.dispatch.triton_unavailable_reason", lambda device: None)

    def pick(d, s_q, s_k, masked=False, varlen=False, windowed=False):
        q, k, v = (torch.empty(2, 64, 4, d, dtype=torch.bfloat16) for _ in range(3))
        return api._pick("auto", q, k, v, 0.0, None, 0.0, varlen, masked, s_q, s_k,
                         windowed=windowed)

    assert pick(128, 1024, 1024) == ("sm90", "sm90")
    assert pick(128, 1024, 1024, varlen=True) == ("triton", "triton")
    assert pick(128, 1024, 1024, masked=True) == ("sm90", "triton")  # causal d=128 bwd: 2k
    assert pick(128, 1024, 1024, masked=True, windowed=True) == ("triton", "triton")
    assert pick(64, 1024, 1024, masked=True) == ("triton", "sm90")  # causal d=64 fwd: 2k
    assert pick(64, 1024, 1024, masked=True, windowed=True) == ("triton", "triton")
    assert pick(128, 64, 1024) == ("triton", "triton")  # few queries: the backward's short loop
    assert pick(256, 512, 512, masked=True) == ("sm90", "sm90")
    if sm90_fwd._persistent(64, False):
        assert pick(64, 512, 512) == ("sm90", "sm90")


def test_sm90_backward_preference_rule(monkeypatch):
    """'auto' takes the sm90 backward where it measured faster (from 2k keys at every head dim
    and mask, from 512 at d=256; batched problems without softcap from 512 keys at d=64 (causal:
    1k) and at d=128 without a mask, the FA grid's short cells), and the fused backward's dQ
    order by head dim and mask; a bad IOATTN_SM90_BWD_DQ_ORDER is refused by name."""
    from ioattn.dense import sm90_bwd

    if os.environ.get("IOATTN_TEST_SM90") == "always":
        pytest.skip("the forced-sm90 suite replaces the rule (tests/conftest.py)")
    for d in (64, 128, 256):
        for masked in (False, True):
            short = 512 if d == 256 else 2048  # d=256 timed faster from 512 keys
            assert sm90_bwd.preferred(d, masked, short, varlen=True)
            assert not sm90_bwd.preferred(d, masked, short // 2, varlen=True)
            # softcap: d in {64, 128} (d=256's column-split backward has none), from 2k
            assert sm90_bwd.preferred(d, masked, 2048, 30.0) == (d != 256)
            assert not sm90_bwd.preferred(d, masked, 1024, 30.0)
            # batched (the queries' length given), not under a sliding window
            batched_from = {(64, False): 512, (64, True): 1024, (128, False): 512,
                            (128, True): 2048, (256, False): 512, (256, True): 512}[d, masked]
            n = batched_from
            assert sm90_bwd.preferred(d, masked, n, max_seqlen_q=n)
            assert not sm90_bwd.preferred(d, masked, n // 2, max_seqlen_q=n // 2)
            assert sm90_bwd.preferred(d, masked, n, max_seqlen_q=n // 2) == (n >= 2048 or d == 256)
            assert sm90_bwd.preferred(d, masked, n, max_seqlen_q=n, window=True) == \
                (n >= 2048 or d == 256)
    monkeypatch.setattr(sm90_bwd, "DQ_ORDER", "auto")
    assert [sm90_bwd.dq_order(d, m) for d, m in ((64, False), (64, True), (128, False),
                                                  (128, True))] == ["alt", "alt", "lag", "after"]
    monkeypatch.setattr(sm90_bwd, "DQ_ORDER", "alt")
    assert sm90_bwd.dq_order(128, False) == "after"  # alt needs the full-width partial (d=64)
    monkeypatch.setattr(sm90_bwd, "SEGMENTS", "auto")  # the step loops: d=64 without a mask
    assert [sm90_bwd.segments(d, m) for d, m in ((64, False), (64, True), (128, False),
                                                  (128, True))] == [True, False, False, False]
    monkeypatch.setattr(sm90_bwd, "SEGMENTS", "sometimes")
    with pytest.raises(ValueError, match="IOATTN_SM90_BWD_SEGMENTS"):
        sm90_bwd.segments(64, False)
    monkeypatch.setattr(sm90_bwd, "DQ_ORDER", "late")
    with pytest.raises(ValueError, match="IOATTN_SM90_BWD_DQ_ORDER"):
        sm90_bwd.dq_order(128, False)


@pytest.mark.skipif(SM90, reason="checks the refusal off Hopper")
def test_sm90_refused_off_hopper(device):
    q, k, v = (torch.randn(1, 16, 2, 64, device=device, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="backend='sm90' cannot run"):
        ioattn.flash_attn_func(q, k, v, backend="sm90")


def test_sm90_kernel_compiles_for_hopper():
    """The Gluon kernels compile for sm90 (on any machine, with Triton's ptxas) with the FA3
    design's instructions, in the PTX and in the SASS: TMA loads, async wgmma, mbarriers,
    setmaxnreg; and (almost) no spills."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # (96 kernels, ~7 min on one core, compiled by up to 8 processes: the GPU machine's suite
    # waited 409 s for this test on one; the limit leaves room for a loaded CI machine)
    jobs = str(min(8, len(os.sched_getaffinity(0))))
    res = subprocess.run([sys.executable, "-m", "ioattn.dense.inspect", "--gluon", "--json",
                          "--jobs", jobs], env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    reports = json.loads(res.stdout)
    names = [r["name"] for r in reports]
    # fwd (also paged): d = 64, 128, 256; bwd dK/dV (also fused with dQ) and dQ: d = 64, 128;
    # the d=64 persistent forward on three consumer warpgroups, the fused backward with dQ
    # issued first, one step late or (d=64) in turn, the d=256 backward's two kernels, the
    # causal fused backward with its steps in masked / unmasked loops (or in one), the dK/dV
    # kernels with LSE / delta held in registers (IOATTN_SM90_BWD_ROW_STATS=0), and the d=64
    # persistent forward on three warpgroups taking turns round robin, also on FA3's 192x128
    # tile (opt-in), the d=64 causal forward as launched at 2k (two warpgroups), and with
    # softcap: the d=128 causal forward, the causal fused backward as launched (d = 64, 128),
    # the d=128 causal dQ kernel, the d=128 paged forward; the forward and backward (fused or
    # column-split dK/dV, dQ) over [rows, heads, d] views (head dims 96 and 192 / 128 read in
    # place, IOATTN_SM90_PAD=tma); and the grouped heaviest-first order: the causal forward
    # (d=128 at 4k, d=256), the causal dK/dV and dQ kernels at d = 128, 256; and
    # (IOATTN_SM90_PAD_NARROW, the default) the forward at 96, 192 / 128 and 192 with QKᵀ over
    # d's own columns and V / O at d_v's own width, the dQ kernel (96, 192 / 128) and the
    # column-split dK/dV kernel (192 / 128) with S and dP over d's and d_v's own columns; and
    # (IOATTN_SM90_FWD_O_TMA=0) the d=128 persistent forward storing O from registers, and
    # (IOATTN_SM90_FWD_O_DEFER=0) with O's stage waited for at the store, not released a
    # block into the next tile; and (the default at d = 64, IOATTN_SM90_BWD_ROWS) the fused
    # d=64 dK/dV kernel on 128-row steps (full: dQ after / first; causal; varlen causal); and
    # (the default up to 8k keys, IOATTN_SM90_FWD_Q_BUFS) the persistent forward with Q in two
    # buffers (d=64 causal at 2k and from 4k, d=128 with and without a mask); and
    # (IOATTN_SM90_FWD_STREAM_COUNTERS) the d=128 causal forward whose last CTA zeroes its
    # tile counter; and (IOATTN_SM90_FWD_Q_REGS, opt-in) the d = 128 / 256 forward with Q's
    # first columns in registers
    assert len(reports) == 101, names
    # QKᵀ over 96 of 128 columns: 6 of 8 HGMMA a key block; (192, 128): 12 of 16 and PV at 128
    hgmma = {r["name"]: r["sass"]["HGMMA"] for r in reports}
    assert (hgmma["sm90 fwd d128 none heads-view narrow QK_COLS=96 128x128 ws"]
            < hgmma["sm90 fwd d128 none heads-view O_COLS=96 128x128 ws"]), hgmma
    assert (hgmma["sm90 fwd d256 causal heads-view narrow QK_COLS=192 128x64 ws"]
            < hgmma["sm90 fwd d256 causal heads-view O_COLS=128 128x64 ws"]), hgmma
    assert (hgmma["sm90 bwd dkdv-cols d256 causal heads-view narrow QK_COLS=192 DP_COLS=128 64 "
                  "keys ws"]
            < hgmma["sm90 bwd dkdv-cols d256 causal heads-view K_COLS=192 V_COLS=128 64 keys ws"])
    assert (hgmma["sm90 bwd dq d256 causal heads-view narrow QK_COLS=192 DP_COLS=128 128x32 ws"]
            < hgmma["sm90 bwd dq d256 causal heads-view K_COLS=192 128x32 ws"]), hgmma
    for r in reports:
        assert r["wgmma"] and r["tma"] and r["warp_specialized"], r
        # 240 registers per consumer warpgroup, compiled as the FlashAttention grid launches
        # them (``inspect._launch_attrs``: its int arguments' divisibility, kv_group = 1);
        # the d=128 dK/dV kernel (dK, dV, Sᵀ, dPᵀ live together) spills a few hundred bytes
        # (more in its varlen and fused forms, whose 24-register producer also zeroes tile
        # rows past the last sequence), the others a few
        limit = 16
        if "dkdv" in r["name"]:
            limit = 1024 if "d128" in r["name"] else 128
            if "rows=128" in r["name"]:  # Sᵀ, dPᵀ [64, 128] beside dK, dV: 84-148 B, varlen 332
                limit = 512
            if "segments=True" in r["name"]:  # (d=128) three copies of the step, each spilling
                limit = 4096
        elif r["name"].startswith("sm90 fwd d128 causal"):
            # the persistent (dynamic) form: tile ids and offsets, with O's TMA store ~150 B
            limit = 256
        elif r["name"].startswith("sm90 fwd d64 causal 192x128"):
            # FA3's d=64 tile at 160 registers: ~80 B (410 without the launch's int hints)
            limit = 512
        elif r["name"].startswith(("sm90 fwd d128 full o-regs", "sm90 fwd d128 full o-nodefer")):
            limit = 64  # (opt-outs of O's TMA store / its deferred release) 8-20 B
        elif "q-regs" in r["name"]:  # (opt-in) 16-20 B outside the key loops
            limit = 64
            assert all(st + ld == 0 for _, st, ld in r["loops"]), r
        assert r["spill_stores"] <= limit, r
        # the default forwards' key-block loops spill nothing (what spills is per-tile code)
        if r["name"].startswith("sm90 fwd d") and " ws" in r["name"] and "-" not in r["name"]:
            assert r["loops"] and all(st == ld == 0 for _, st, ld in r["loops"]), r
        assert r["shared_bytes"] <= 232448, r  # sm90's 227 KB of shared memory per block
        assert r["mbarrier_waits"] > 0, r
        # the fused backward adds dQ with TMA reductions (cp.reduce.async.bulk.tensor)
        assert r["tma_reduce"] == ("dkdv+dq" in r["name"]), r
        sass = r["sass"]  # what the GPU runs: HGMMA, TMA loads, setmaxnreg, mbarrier ops
        assert sass["HGMMA"] > 0 and sass["UTMALDG"] > 0 and sass["USETMAXREG"] > 0, r
        assert sass["SYNCS"] > 0, r
        # softcap's tanh on the MUFU (tanh.approx, the default), in the softcap forms only
        approx = os.environ.get("IOATTN_SM90_SOFTCAP_APPROX", "1").lower() in ("1", "true", "on")
        assert (sass["MUFU.TANH"] > 0) == ("softcap" in r["name"] and approx), r
        # TMA stores: the backward's dK / dV (d <= 128), the batched persistent forward's O on
        # two warpgroups and 128 keys (IOATTN_SM90_FWD_O_TMA; "o-regs" without it)
        o_tma = (("128x128" in r["name"] or "128x192" in r["name"]) and " fwd " in r["name"]
                 and not any(f in r["name"] for f in ("heads-view", "o-regs", "varlen", "paged")))
        if "dkdv+dq" in r["name"] and "heads-view" not in r["name"] or o_tma:
            assert sass["UTMASTG"] > 0, r
        if "o-regs" in r["name"]:
            assert sass["UTMASTG"] == 0, r


_EXP_ORDER_SCRIPT = r'''
import sys
from ioattn.dense import inspect as ins

# one kernel of the sm90 compile report, as its launcher configures it, by name
sass = ins.gluon_sass(sys.argv[1], int(sys.argv[2]))
# the steady state: from the first wait that leaves one wgmma group (PV_{j-1}; dPᵀ) in flight to
# the wait for it
i = sass.index("WARPGROUP.DEPBAR.LE gsb0, 0x1")
j = sass.index("WARPGROUP.DEPBAR.LE gsb0, 0x0", i)
print(sass[i:j].count("MUFU.EX2"))
'''


@pytest.mark.parametrize("env,name,d,exps", [
    ("", "sm90 fwd d64 full 192x128 ws", 64, 64),  # (the default: early on this tile)
    ("IOATTN_SM90_FWD_EXP_EARLY", "sm90 fwd d128 full 128x128 ws", 128, 64),
    ("IOATTN_SM90_FWD_EXP_EARLY", "sm90 fwd d64 full persistent 192x128 pingpong ws", 64, 64),
    ("IOATTN_SM90_BWD_EXP_EARLY", "sm90 bwd dkdv+dq alt d64 full 128 keys ws", 64, 32),
    ("IOATTN_SM90_BWD_EXP_EARLY", "sm90 bwd dkdv+dq lag d128 full 128 keys ws", 128, 32)],
    ids=["fwd-d64-192x128", "fwd-d128", "fwd-d64-192x128-pingpong", "bwd-d64", "bwd-d128"])
def test_sm90_exp_early_schedule(env, name, d, exps):
    """The d=64 192x128 tile without a mask by default, and the other forms with
    IOATTN_SM90_FWD_EXP_EARLY=1 / IOATTN_SM90_BWD_EXP_EARLY=1, keep a step's exponentials (a
    thread's 64 of a forward 128-key block, in its masked or unmasked branch; 32 of a backward
    step's Pᵀ) before the wait for the GEMM they should overlap (PV_{j-1}; dPᵀ) in the sm90
    SASS; off, ptxas hoists that wait above most of them."""
    import subprocess
    import sys

    # (the other switches at their defaults: the kernel names are the default launches')
    env_ = {k: v for k, v in os.environ.items()
            if k != "TRITON_INTERPRET" and not k.startswith("IOATTN_")}
    if env:
        env_[env] = "1"
    res = subprocess.run([sys.executable, "-c", _EXP_ORDER_SCRIPT, name, str(d)], env=env_,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert int(res.stdout.strip()) >= exps, res.stdout

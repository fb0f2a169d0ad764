"""The portable kernels' kept launches (``IOATTN_BIND``, ``op.BIND``): the op keys a batched
call by its memo signature and pointer alignments; ``triton_fwd.attn_fwd`` keeps its launch
under the key and repeats it with the call's five addresses, ``triton_bwd.attn_bwd`` its three
(preprocess, dK/dV, dQ). The wiring is checked on any machine with a recording launcher (on the
GPU machine over CUDA tensors: nothing launches, and CPU ones would need the interpreter); the
kept launches themselves on the GPU."""
from __future__ import annotations

import pytest
import torch

import ioattn
from ioattn import launch
from ioattn.dense import configs, op, triton_bwd, triton_fwd
from ioattn.reference import attention_ref
from ioattn.testing import alibi_slopes, assert_close_rule
from tests.conftest import DEVICE, ON_GPU
from tests.dense.test_attention import _check_grads

BF16, FP16 = torch.bfloat16, torch.float16


def _qkv(device, b=2, s_q=37, s_k=53, h=4, h_k=2, d=64, dtype=BF16, grad=False):
    return tuple(t.requires_grad_(grad) for t in (
        torch.randn(b, s_q, h, d, device=device, dtype=dtype),
        torch.randn(b, s_k, h_k, d, device=device, dtype=dtype),
        torch.randn(b, s_k, h_k, d, device=device, dtype=dtype)))


class _RecordingLauncher:
    """Stands in for ``launch.launcher(kernel)``: records plain launches and kept ones, and
    keeps a recorder as the Bound (which says it launched)."""

    def __init__(self):
        self.plain, self.kept, self.repeats = [], [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.plain.append((grid, args, kwargs))

    def bind_kept(self, cache, key, grid, args, kwargs, slots):
        self.kept.append((key, grid, args, kwargs, slots))
        return launch.keep(cache, key, _RecordedBound(self, key, slots))

    def bind(self, grid, args, kwargs, slots):  # (keyed by the kernel's name, ``named``)
        self.kept.append((self.kernel, grid, args, kwargs, slots))
        return _RecordedBound(self, self.kernel, slots)

    def named(self, kernel):
        self.kernel = kernel.__name__
        return self


class _RecordedBound:
    """A kept launch of ``_RecordingLauncher``: records each repeat's values (the slots as
    ``launch.Bound`` has them)."""

    def __init__(self, rec, key, slots):
        self.rec, self.key, self.slots = rec, key, slots

    def __call__(self, *values):
        assert len(values) == len(self.slots), (self.key, values, self.slots)
        self.rec.repeats.append((self.key, values))
        return True


def test_kept_forward_wiring(monkeypatch):
    """With BIND: the first batched call of a signature binds (slots q, k, v, out, lse: the
    first five arguments, the call's own tensors), a repeat with fresh tensors launches the
    kept one with their five addresses, another mask, a new shape, a misaligned q or a swapped
    config table binds anew, and calls with ALiBi, varlen rows or the switch off launch the
    plain way."""
    rec = _RecordingLauncher()
    monkeypatch.setattr(triton_fwd, "launcher", lambda kernel: rec)
    monkeypatch.setattr(op, "BIND", True)
    op.clear_memos()
    q, k, v = _qkv(DEVICE)
    out, lse, _ = ioattn.flash_attn_func(q, k, v, causal=True, backend="triton",
                                         return_attn_probs=True)
    assert not rec.plain and len(rec.kept) == 1 and not rec.repeats
    key, grid, args, kwargs, slots = rec.kept[0]
    assert slots == (0, 1, 2, 3, 4)
    assert [a.data_ptr() for a in args[:5]] == [t.data_ptr() for t in (q, k, v, out, lse)]
    assert kwargs["HAS_RIGHT"] and not kwargs["HAS_ALIBI"]
    q2, k2, v2 = _qkv(DEVICE)
    out2, lse2, _ = ioattn.flash_attn_func(q2, k2, v2, causal=True, backend="triton",
                                           return_attn_probs=True)
    assert len(rec.kept) == 1 and rec.repeats == [
        (key, tuple(t.data_ptr() for t in (q2, k2, v2, out2, lse2)))]
    ioattn.flash_attn_func(q2, k2, v2, causal=False, backend="triton")  # (another signature)
    assert len(rec.kept) == 2 and rec.kept[1][0] != key
    ioattn.flash_attn_func(*_qkv(DEVICE, s_q=41), causal=True, backend="triton")  # (a new shape)
    assert len(rec.kept) == 3 and rec.kept[2][0] != key
    big = torch.randn(q.numel() + 1, dtype=BF16, device=DEVICE)
    q_odd = big[1:].view_as(q)  # (2-byte aligned: its own Bound)
    q_odd.copy_(q)
    ioattn.flash_attn_func(q_odd, k, v, causal=True, backend="triton")
    assert len(rec.kept) == 4 and rec.kept[3][0] != key and len(rec.repeats) == 1
    swapped = configs.fwd_config  # (a swapped config table, as benchmarks/tune.py does)
    monkeypatch.setattr(configs, "fwd_config", lambda *a: swapped(*a))
    ioattn.flash_attn_func(q2, k2, v2, causal=True, backend="triton")
    assert len(rec.kept) == 5 and len(rec.repeats) == 1
    ioattn.flash_attn_func(q, k, v, causal=True, backend="triton",
                           alibi_slopes=alibi_slopes(None, 4, DEVICE))
    cu = torch.tensor([0, 37, 74], dtype=torch.int32, device=DEVICE)
    ioattn.flash_attn_varlen_func(q.view(-1, 4, 64), q.view(-1, 4, 64)[:, :2],
                                  q.view(-1, 4, 64)[:, 2:], cu, cu, 37, 37, backend="triton")
    monkeypatch.setattr(op, "BIND", False)
    op.clear_memos()
    ioattn.flash_attn_func(q, k, v, causal=True, backend="triton")
    assert len(rec.plain) == 3 and len(rec.kept) == 5 and len(rec.repeats) == 1


def test_kept_backward_wiring(monkeypatch):
    """With BIND: the first backward of a signature binds its three launches under (key, 0 / 1
    / 2) with the call's tensors in their slots (preprocess: O, dO, dLSE-or-delta, delta;
    dK/dV: q, k, v, dO, LSE, delta, dK, dV; dQ: the same six, dQ); a repeat with fresh tensors
    launches the three with their addresses; a dLSE (the LSE's gradient) is another signature;
    with the switch off all four launch plainly."""
    rec = _RecordingLauncher()
    monkeypatch.setattr(triton_bwd, "launcher", lambda kernel: rec)
    monkeypatch.setattr(triton_fwd, "launcher", lambda kernel: rec)
    monkeypatch.setattr(op, "BIND", True)
    op.clear_memos()
    grads = []  # (each backward's dq, dk, dv)
    orig_bwd = op.bwd_impl
    monkeypatch.setattr(op, "bwd_impl", lambda *a: grads.append(orig_bwd(*a)) or grads[-1])

    def step(lse_grad=False):
        q, k, v = _qkv(DEVICE, grad=True)
        out, lse, _ = ioattn.flash_attn_func(q, k, v, causal=True, backend="triton",
                                             return_attn_probs=True)
        # (the stand-in launched no kernel: the sums' gradients are ones whatever the values)
        loss = out.float().sum() + (lse.sum() if lse_grad else 0)
        rec.kept.clear(), rec.repeats.clear()
        loss.backward()
        return q, k, v, out, lse

    q, k, v, out, lse = step()
    keys = [kept[0] for kept in rec.kept]
    assert [k[1] for k in keys] == [0, 1, 2] and len({k[0] for k in keys}) == 1, keys
    assert [kept[4] for kept in rec.kept] == [(0, 1, 2, 3), tuple(range(8)), tuple(range(7))]
    pre, dkdv, dq = ([a.data_ptr() for a in kept[2][:n]] for kept, n in zip(rec.kept, (4, 8, 7)))
    dout, delta = pre[1], pre[3]
    assert pre[0] == out.data_ptr() and pre[2] == delta  # (delta stands in for the absent dLSE)
    want = [t.data_ptr() for t in (q, k, v)] + [dout, lse.data_ptr(), delta]
    assert dkdv == want + [t.data_ptr() for t in grads[-1][1:]] and len(set(dkdv)) == 8
    assert dq == want + [grads[-1][0].data_ptr()]
    q, k, v, out, lse = step()  # (fresh tensors: the kept launches with their addresses)
    assert not rec.kept and [r[0] for r in rec.repeats] == keys
    (_, pre_v), (_, dkdv_v), (_, dq_v) = rec.repeats
    dout_p, delta_p = pre_v[1], pre_v[3]
    assert pre_v[0] == out.data_ptr() and pre_v[2] == delta_p
    ptrs = tuple(t.data_ptr() for t in (q, k, v)) + (dout_p, lse.data_ptr(), delta_p)
    dq_t, dk_t, dv_t = grads[-1]
    assert dkdv_v == ptrs + (dk_t.data_ptr(), dv_t.data_ptr()) and dq_v == ptrs + (dq_t.data_ptr(),)
    step(lse_grad=True)  # (dLSE given: its own launches)
    assert len(rec.kept) == 3 and rec.kept[0][0][0] != keys[0][0]
    assert rec.kept[0][2][2].data_ptr() != rec.kept[0][2][3].data_ptr()  # (dLSE, delta)
    monkeypatch.setattr(op, "BIND", False)
    op.clear_memos()
    rec.plain.clear()
    step()
    assert not rec.kept and not rec.repeats and len(rec.plain) == 4  # (forward + three)


@pytest.mark.skipif(not ON_GPU, reason="kept launches are Triton's compiled kernels (GPU)")
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(17, 3), softcap=5.0)],
                         ids=["full", "causal", "window-softcap"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_kept_launches_on_the_gpu(kw, dtype, monkeypatch):
    """With BIND on the GPU: three rounds of fresh inputs of one signature (odd lengths, GQA,
    head dim 96), forward and backward on the portable kernels, each output and gradient
    against the reference; the first round binds, the next two repeat (one C call a kernel:
    1 forward + 3 backward each, at addresses the other round does not use), none steps
    aside."""
    monkeypatch.setattr(op, "BIND", True)
    op.clear_memos()
    repeats, values = [], []
    orig_call = launch.Bound.__call__

    def call(self, *v):
        values.append(v)
        repeats.append(orig_call(self, *v))
        return repeats[-1]
    monkeypatch.setattr(launch.Bound, "__call__", call)
    alive = []  # (every round's tensors stay allocated, so no round reuses another's addresses)
    for _ in range(3):
        q, k, v = _qkv("cuda", b=3, s_q=113, s_k=203, h=6, h_k=2, d=96, dtype=dtype, grad=True)
        out, lse, _ = ioattn.flash_attn_func(q, k, v, backend="triton", return_attn_probs=True,
                                             **kw)
        ref, _ = attention_ref(q, k, v, **kw)
        pt, _ = attention_ref(q, k, v, upcast=False, **kw)
        assert_close_rule("out", out, ref, pt)
        g = torch.randn_like(out)
        got = _check_grads("kept", out, ref, pt, g, (q, k, v))
        # (and the backward's delta: a block of its size held, so the next round's is another)
        alive.append((q, k, v, out, lse, g, got, torch.empty_like(lse), torch.empty_like(lse)))
    assert len(triton_fwd._BOUND) == 1 and len(triton_bwd._BOUND) == 3
    assert repeats == [True] * 8, repeats
    for a, b in zip(values[:4], values[4:]):  # (rounds 2 and 3: no address in common)
        assert not set(a) & set(b), (a, b)


def test_kept_sm90_forward_wiring(monkeypatch):
    """The sm90 forward's kept launches keyed by the op's signature (``attn_fwd_sm90``'s
    bind_key, with the module's switches): the first batched call binds (slots: the four
    descriptors' bases, O, LSE, the three unused pointers, the tile counter), a repeat with
    fresh tensors launches it with their addresses, a changed module switch or another mask
    binds anew, and with the op's switch off the forward keys the call itself. Run through the
    op's implementation with the kernel's launcher recorded (no GPU needed: nothing launches)."""
    from ioattn.dense import sm90_fwd

    rec = _RecordingLauncher()
    rec.names = launch.launcher(sm90_fwd._attn_fwd_sm90).names
    counter = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(sm90_fwd, "launcher", lambda kernel: rec)
    monkeypatch.setattr(sm90_fwd, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(sm90_fwd, "_tile_counter", lambda device: counter)
    monkeypatch.setattr(sm90_fwd, "BIND", True)
    monkeypatch.setattr(sm90_fwd, "_BOUND", {})
    monkeypatch.setattr(sm90_fwd, "PERSISTENT_MODE", "auto")
    monkeypatch.setattr(op, "BIND", True)
    op.clear_memos()

    def call(q, k, v, causal=True):
        return op.fwd_impl(q, k, v, None, None, q.shape[1], k.shape[1], q.shape[-1] ** -0.5,
                           -1, 0 if causal else -1, 0.0, None, 0.0, None, impl="sm90")

    q, k, v = _qkv(DEVICE, d=128)
    out, lse = call(q, k, v)
    assert not rec.plain and len(rec.kept) == 1 and not rec.repeats
    key, grid, args, kwargs, slots = rec.kept[0]
    assert kwargs["DYNAMIC"] and kwargs["COUNTER"] is counter
    assert slots == tuple(range(9)) + (rec.names.index("COUNTER"),)
    assert [a.base.data_ptr() for a in args[:4]] == [t.data_ptr() for t in (q, k, v, out)]
    assert [a.data_ptr() for a in args[4:9]] == [out.data_ptr()] + [lse.data_ptr()] * 4
    q2, k2, v2 = _qkv(DEVICE, d=128)
    out2, lse2 = call(q2, k2, v2)
    assert len(rec.kept) == 1 and rec.repeats == [
        (key, (q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), out2.data_ptr(), out2.data_ptr())
         + (lse2.data_ptr(),) * 4 + (counter.data_ptr(),))]
    monkeypatch.setattr(sm90_fwd, "O_DEFER", not sm90_fwd.O_DEFER)  # (a switch: a new form)
    call(q2, k2, v2)
    assert len(rec.kept) == 2 and rec.kept[1][0] != key and len(rec.repeats) == 1
    call(q2, k2, v2, causal=False)  # (another signature)
    assert len(rec.kept) == 3 and len(rec.repeats) == 1
    monkeypatch.setattr(sm90_fwd, "PERSISTENT_MODE", "static")  # (no counter)
    call(q2, k2, v2, causal=False)
    call(q, k, v, causal=False)
    assert len(rec.kept) == 4 and rec.kept[3][4] == tuple(range(9))
    assert rec.kept[3][3]["COUNTER"] is None
    assert rec.repeats[-1][1] == (q.data_ptr(), k.data_ptr(), v.data_ptr()) + rec.repeats[-1][1][3:]
    assert len(rec.repeats[-1][1]) == 9
    monkeypatch.setattr(op, "BIND", False)  # (the forward's own key: repeats all the same)
    op.clear_memos()
    call(q, k, v, causal=False)
    call(q2, k2, v2, causal=False)
    assert len(rec.kept) == 5 and len(rec.repeats) == 3
    assert rec.kept[4][0] not in {kept[0] for kept in rec.kept[:4]}
    monkeypatch.setattr(op, "BIND", True)  # (the forward's switch off: plain launches only,
    monkeypatch.setattr(sm90_fwd, "BIND", False)  # whatever key the op passes)
    op.clear_memos()
    call(q, k, v)
    call(q2, k2, v2)
    assert len(rec.plain) == 2 and len(rec.kept) == 5 and len(rec.repeats) == 3


def test_kept_sm90_backward_wiring(monkeypatch):
    """The sm90 backward's kept launches keyed by the op's signature (``attn_bwd_sm90``'s
    bind_key, with the fused form, the module's switches and the SM count): the first batched
    call keeps the preprocess (slots O, dO, dLSE-or-delta, delta) and the dK/dV kernel (slots:
    Q, dO, K, V descriptors, the fused dQ buffer's, dK's and dV's (TMA stores), dK, dV, LSE,
    delta, the two unused pointers); a repeat with fresh tensors launches them at their
    addresses with a new dQ buffer, whose (zero) values it copies into dQ; ``deterministic``
    (two kernels: the dQ kernel's slots Q, dO, K, V, dQ, LSE, delta, two unused), d = 256 (the
    column-split kernel, then dQ), a changed switch or a dLSE (its own slot) bind anew; with the
    module's switch off every launch is plain. Run through the op's implementation with the
    launchers recorded (nothing launches; outputs poisoned)."""
    from types import SimpleNamespace

    from ioattn.dense import sm90_bwd

    rec = _RecordingLauncher()
    monkeypatch.setattr(sm90_bwd, "launcher", rec.named)
    monkeypatch.setattr(triton_bwd, "launcher", rec.named)
    monkeypatch.setattr(sm90_bwd, "BIND", True)
    monkeypatch.setattr(sm90_bwd, "_BOUND", {})
    monkeypatch.setattr(op, "BIND", True)
    monkeypatch.setattr(op, "POISON_OUTPUTS", True)
    op.clear_memos()

    def call(d=128, deterministic=False, dlse=False):
        q, k, v = _qkv(DEVICE, d=d)
        t = SimpleNamespace(q=q, k=k, v=v, out=torch.randn_like(q), dout=torch.randn_like(q),
                            lse=torch.randn(q.shape[0], q.shape[2], q.shape[1], device=DEVICE))
        t.dlse = torch.randn_like(t.lse) if dlse else None
        rec.kept.clear(), rec.repeats.clear()
        t.dq, t.dk, t.dv = op.bwd_impl(
            t.dout, q, k, v, t.out, t.lse, t.dlse, None, None, q.shape[1], k.shape[1], d ** -0.5,
            -1, 0, 0.0, None, 0.0, None, impl="sm90", deterministic=deterministic)
        return t

    def ptrs(*ts):
        return tuple(t.data_ptr() for t in ts)

    def delta_of(t, pre_values):  # (delta: the backward's own, no other tensor's address)
        delta = pre_values[3]
        assert delta not in ptrs(t.q, t.k, t.v, t.out, t.dout, t.lse, t.dq, t.dk, t.dv)
        assert pre_values[:3] == ptrs(t.out, t.dout) + (
            delta if t.dlse is None else t.dlse.data_ptr(),)
        return delta

    t = call()
    assert [kept[0] for kept in rec.kept[1:]] == ["_bwd_dkdv_sm90"] and not rec.plain
    pre_key, _, pre_args, _, pre_slots = rec.kept[0]
    assert pre_slots == (0, 1, 2, 3) and pre_key in triton_bwd._BOUND
    delta = pre_args[3]
    assert ptrs(*pre_args[:4]) == ptrs(t.out, t.dout, delta, delta)
    _, _, args, kwargs, slots = rec.kept[1]
    assert slots == tuple(range(13)) and kwargs["FUSED_DQ"] and kwargs["TMA_STORE"]
    acc = args[4].base
    assert acc.dtype == torch.float32 and acc.shape == t.q.shape
    assert [a.base.data_ptr() for a in args[:7]] == list(ptrs(t.q, t.dout, t.k, t.v, acc, t.dk,
                                                              t.dv))
    assert ptrs(*args[7:13]) == ptrs(t.dk, t.dv, t.lse, delta, t.lse, t.lse)
    assert len(sm90_bwd._BOUND) == 1
    t = call()  # (fresh tensors: the kept launches)
    assert not rec.kept and [r[0] for r in rec.repeats] == [pre_key, "_bwd_dkdv_sm90"]
    (_, pre_v), (_, main_v) = rec.repeats
    delta = delta_of(t, pre_v)
    lp = t.lse.data_ptr()
    assert main_v[:4] == ptrs(t.q, t.dout, t.k, t.v)
    assert main_v[5:] == ptrs(t.dk, t.dv, t.dk, t.dv, t.lse) + (delta, lp, lp)
    assert main_v[4] not in main_v[:4] + main_v[5:]  # (a new dQ buffer)
    assert torch.equal(t.dq, torch.zeros_like(t.dq))  # (the buffer's values copied into dQ)
    call(deterministic=True)  # (the two-kernel form: another key)
    assert [kept[0] for kept in rec.kept[1:]] == ["_bwd_dkdv_sm90", "_bwd_dq_sm90"]
    assert not rec.kept[1][3]["FUSED_DQ"] and rec.kept[2][4] == tuple(range(9))
    t = call(deterministic=True)
    (_, pre_v), (_, main_v), (_, dq_v) = rec.repeats
    delta, lp = delta_of(t, pre_v), t.lse.data_ptr()
    assert main_v[4] == t.q.data_ptr()  # (q's descriptor stands in for the dQ buffer's)
    assert dq_v == ptrs(t.q, t.dout, t.k, t.v, t.dq, t.lse) + (delta, lp, lp)
    assert torch.isnan(t.dq).all()  # (the dQ kernel writes it: nothing copied)
    call(d=256)  # (the column-split kernel, then dQ)
    assert [kept[0] for kept in rec.kept[1:]] == ["_bwd_dkdv_cols_sm90", "_bwd_dq_sm90"]
    assert rec.kept[1][4] == tuple(range(10))
    t = call(d=256)
    (_, pre_v), (_, cols_v), (_, dq_v) = rec.repeats
    delta, lp = delta_of(t, pre_v), t.lse.data_ptr()
    assert cols_v == ptrs(t.q, t.dout, t.k, t.v, t.dk, t.dv, t.lse) + (delta, lp, lp)
    assert dq_v == ptrs(t.q, t.dout, t.k, t.v, t.dq, t.lse) + (delta, lp, lp)
    call(dlse=True)  # (dLSE given: its own launches, dLSE in the preprocess's third slot)
    assert len(rec.kept) == 2 and not rec.repeats
    assert rec.kept[0][2][2].data_ptr() != rec.kept[0][2][3].data_ptr()  # (dLSE, delta)
    t = call(dlse=True)
    assert not rec.kept and len(rec.repeats) == 2
    delta_of(t, rec.repeats[0][1])
    monkeypatch.setattr(sm90_bwd, "TMA_STORE", False)  # (a switch: a new form)
    call()
    assert len(rec.kept) == 2 and not rec.repeats and not rec.kept[1][3]["TMA_STORE"]
    t = call()
    (_, pre_v), (_, main_v) = rec.repeats
    assert main_v[5:7] == (t.q.data_ptr(),) * 2  # (q's descriptor stands in for dK's and dV's)
    monkeypatch.setattr(sm90_bwd, "BIND", False)  # (the backward's switch off: plain launches)
    n_bound = len(sm90_bwd._BOUND)
    rec.plain.clear()
    call()
    call()
    assert not rec.kept and not rec.repeats and len(rec.plain) == 4
    assert len(sm90_bwd._BOUND) == n_bound

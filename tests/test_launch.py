"""ioattn.launch: a repeated signature launches the kept CompiledKernel directly, with every
parameter in order; anything that changes what Triton specializes on goes through Triton's own
call again. A stand-in kernel on the CPU (the GPU suite runs every kernel through it)."""
from __future__ import annotations

import inspect

import pytest
import torch

from ioattn import launch


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty, is_constexpr=False):
        self.name, self.default, self.is_constexpr = name, default, is_constexpr

    @property
    def has_default(self):
        return self.default is not inspect.Parameter.empty


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("meta-of", grid, stream, args)


class _Kernel:
    arg_names = ["X", "n", "D", "BLOCK", "FLAG", "scale"]
    params = [_Param("X"), _Param("n"), _Param("D"), _Param("BLOCK", is_constexpr=True),
              _Param("FLAG", False, is_constexpr=True), _Param("scale", 1.5)]

    def __init__(self):
        self.compiled = _Compiled()
        self.plain = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.plain.append((grid, args, kwargs))
            return self.compiled
        return call


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(launch, "_hooks", lambda: (None, None))
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 1234)
    kernel = _Kernel()
    lau = launch.Launcher(kernel)
    lau.fast = True  # (the interpreter turns it off)
    return kernel, lau


def _desc(t):
    return launch.Desc(t, (t.shape[0], t.shape[1]), (t.stride(0), 1), (16, t.shape[1]), "layout")


def test_repeat_launches_directly(fast, monkeypatch):
    kernel, lau = fast
    monkeypatch.setattr(launch.Desc, "real", lambda self: ("real", self.base))
    x = torch.randn(64, 32)
    lau[(3, 2)](x, 7, _desc(x), BLOCK=16)
    assert len(kernel.plain) == 1 and not kernel.compiled.runs
    assert kernel.plain[0][1][2] == ("real", x)  # Triton's call gets checked descriptors
    y = torch.randn(64, 32)  # same signature, other data
    d = _desc(y)
    lau[(3, 2)](y, 7, d, BLOCK=16)
    assert len(kernel.plain) == 1
    (run,) = kernel.compiled.runs
    # grid padded to 3 dims, stream, function, metadata, no hooks, then every parameter in order
    # (FLAG's default filled in)
    assert run[:9] == (3, 2, 1, 1234, "fn", "meta", None, None, None)
    assert run[9] is y and run[10] == 7 and run[11] is d and run[12:] == (16, False, 1.5)


@pytest.mark.parametrize("n", [9, 23, -5, 2**31 - 1])
def test_ints_key_as_triton_specializes_them(fast, n):
    """A length that changes between calls keeps the kept kernel as long as Triton would
    specialize it the same way (not 1, not a multiple of 16, 32-bit), as does a float."""
    kernel, lau = fast
    x = torch.randn(8, 8)
    lau[(1,)](x, 7, None, BLOCK=4, scale=0.5)
    lau[(1,)](x, n, None, BLOCK=4, scale=2.0)
    assert len(kernel.plain) == 1
    (run,) = kernel.compiled.runs
    assert run[10] == n and run[14] == 2.0


@pytest.mark.parametrize("change", ["int-one", "int-16", "int-64bit", "int-float", "dtype", "align",
                                    "constexpr", "constexpr-positional", "desc_shape"])
def test_new_signature_goes_through_triton(fast, monkeypatch, change):
    kernel, lau = fast
    monkeypatch.setattr(launch.Desc, "real", lambda self: self)
    x = torch.randn(64, 32)
    lau[(1,)](x, 7, _desc(x), 16)  # BLOCK (a constexpr) positional
    n, block, y = 7, 16, torch.randn(64, 32)
    if change == "int-one":  # Triton makes a 1 a constant of the kernel
        n = 1
    elif change == "int-16":  # and marks a multiple of 16 as such
        n = 32
    elif change == "int-64bit":
        n = 2**31
    elif change == "int-float":
        n = 7.0
    elif change == "dtype":
        y = y.half()
    elif change == "align":
        y = torch.randn(64 * 32 + 1)[1:].view(64, 32)  # 4 bytes past a 16-byte boundary
    elif change.startswith("constexpr"):  # by keyword, or positional as the first call's
        block = 32
    d = _desc(y) if change != "desc_shape" else _desc(y[:32])
    if change == "constexpr":
        lau[(1,)](y, n, d, BLOCK=block)
    else:
        lau[(1,)](y, n, d, block)
    assert len(kernel.plain) == 2 and not kernel.compiled.runs


def test_plain_path_for_an_unknown_argument(fast):
    kernel, lau = fast
    x = torch.randn(8, 8)
    lau[(1,)](x, 1, [1, 2], BLOCK=4)  # a list: not in the signature's types
    lau[(1,)](x, 1, [1, 2], BLOCK=4)
    assert len(kernel.plain) == 2 and not kernel.compiled.runs


def test_launch_hooks_get_what_triton_gives_them(fast, monkeypatch):
    kernel, lau = fast
    x = torch.randn(8, 8)
    lau[(1,)](x, 1, None, BLOCK=4)
    enter, leave = (lambda *a: None), (lambda *a: None)
    monkeypatch.setattr(launch, "_hooks", lambda: (enter, leave))
    lau[(1,)](x, 1, None, BLOCK=4)
    (run,) = kernel.compiled.runs
    assert run[6] == ("meta-of", (1,), 1234, (x, 1, None, 4, False, 1.5))
    assert run[7] is enter and run[8] is leave


def test_exit_hook_alone_gets_the_metadata(fast, monkeypatch):
    kernel, lau = fast
    x = torch.randn(8, 8)
    lau[(1,)](x, 1, None, BLOCK=4)
    leave = lambda *a: None  # noqa: E731
    monkeypatch.setattr(launch, "_hooks", lambda: (None, leave))
    lau[(1,)](x, 1, None, BLOCK=4)
    (run,) = kernel.compiled.runs
    assert run[6][0] == "meta-of" and run[7] is None and run[8] is leave


def test_not_a_compiled_kernel_stays_on_the_plain_path(fast):
    kernel, lau = fast
    kernel.compiled = object()  # what Triton's call returned: no run / function / metadata
    x = torch.randn(8, 8)
    for _ in range(3):
        lau[(1,)](x, 1, None, BLOCK=4)
    assert len(kernel.plain) == 3


def test_a_parameter_without_a_value_goes_to_triton(fast):
    kernel, lau = fast
    x = torch.randn(8, 8)
    lau[(1,)](x, 1, None)  # BLOCK missing: Triton's call is the one to say so
    lau[(1,)](x, 1, None)
    assert len(kernel.plain) == 2 and not kernel.compiled.runs


def test_triton_debug_switch_is_in_the_signature(fast, monkeypatch):
    kernel, lau = fast
    x = torch.randn(8, 8)
    lau[(1,)](x, 1, None, BLOCK=4)
    monkeypatch.setattr(launch, "_knobs", lambda: (True, ""))
    lau[(1,)](x, 1, None, BLOCK=4)
    assert len(kernel.plain) == 2 and not kernel.compiled.runs


def test_only_jit_functions_take_the_fast_path():
    assert not launch._is_jit_function(_Kernel())


def test_empty_hook_chains_are_no_hooks():
    from triton.knobs import HookChain

    chain = HookChain()
    assert launch._live(chain) is None and launch._live(None) is None
    chain.add(print)
    assert launch._live(chain) is chain
    assert launch._live(print) is print  # a plain function (set directly) stays


def test_interpreter_never_takes_the_fast_path():
    if not launch._INTERPRET:
        pytest.skip("the interpreter is off")
    assert not launch.Launcher(_Kernel()).fast


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "sm90"])
def test_repeat_calls_on_the_gpu(backend):
    """Calls of one signature after the first run through the kept kernels: the same results
    bitwise (deterministic backward), and right again after a call of another signature and
    with inputs at an unaligned offset (their own signature)."""
    import ioattn
    from ioattn.dispatch import sm90_unavailable_reason
    from ioattn.reference import attention_ref
    from ioattn.testing import assert_close_rule

    if backend == "sm90" and sm90_unavailable_reason(torch.device("cuda")) is not None:
        pytest.skip(sm90_unavailable_reason(torch.device("cuda")))

    def run(s, offset=0):
        buf = torch.randn(3 * 2 * s * 4 * 128 + offset, device="cuda", dtype=torch.bfloat16)
        q, k, v = (t.view(2, s, 4, 128).requires_grad_()
                   for t in buf[offset:].split(2 * s * 4 * 128))
        dout = torch.randn_like(q)
        got = []
        for _ in range(3):
            o = ioattn.flash_attn_func(q, k, v, causal=True, deterministic=True, backend=backend)
            got.append((o.detach(),) + torch.autograd.grad(o, (q, k, v), dout))
        for later in got[1:]:
            for a, b in zip(got[0], later):
                assert torch.equal(a, b)
        ref = attention_ref(q, k, v, causal=True)[0]
        pt = attention_ref(q, k, v, causal=True, upcast=False)[0]
        assert_close_rule("out", got[0][0], ref, pt)

    run(640)
    run(200)
    run(640, offset=1)  # 2 bytes past an aligned base
    run(640)
    if backend == "sm90":
        from ioattn.dense import sm90_fwd

        lau = launch.launcher(sm90_fwd._attn_fwd_sm90)
        assert any(c is not False for c in lau.cache.values())


def test_ints_triton_refuses_and_signed_zero_constexprs_go_to_triton(fast):
    """An int outside int64 / uint64 has no key (Triton's call refuses it; its launcher would
    wrap a u64), and a constexpr 0.0 and -0.0 compile apart, so they key apart."""
    kernel, lau = fast
    x = torch.randn(8, 8)
    lau[(1,)](x, 2**63, None, BLOCK=4)
    lau[(1,)](x, 2**64 + 5, None, BLOCK=4)
    assert len(kernel.plain) == 2 and not kernel.compiled.runs
    lau[(1,)](x, 3, None, BLOCK=0.0)
    lau[(1,)](x, 3, None, BLOCK=-0.0)
    assert len(kernel.plain) == 4 and not kernel.compiled.runs


def test_int_and_float_keys_match_tritons_specialization():
    """Two values the launcher keys alike must be specialized alike by Triton itself (else a
    kernel compiled for one would run the other): checked against Triton's own specializer for
    ints around the 1 / 16 / 32-bit / 64-bit edges and for floats, as a non-constexpr argument
    with and without alignment specialization."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**32,
            -2**31, -2**31 - 1, -2**31 - 16, 2**63 - 16, 2**63, 2**64 - 16, 2**64 - 1]
    floats = [0.0, 1.0, -2.5, 1e30, float("inf")]
    for values, sig in ((ints, launch._int_sig), (floats, launch._float_sig)):
        for align in (True, False):
            seen = {}
            for x in values:
                triton_key = native_specialize_impl(BaseBackend, x, False, True, align)
                assert seen.setdefault(sig(x), triton_key) == triton_key, (x, sig(x))



def test_bound_launch_passes_what_tritons_launch_passes(monkeypatch):
    """``launch.bound_launch``: the arguments its one C call passes are those Triton 3.6's own
    launch passes (``CudaLauncher.__call__`` through ``wrap_handle_tensordesc``: the real
    wrapper here, around a recording stand-in for the C function, found by ``_raw_launch``):
    the 13 base arguments, every parameter in order (constexprs included), TMA descriptors
    expanded in place, tensors as their addresses; the slots take each call's values.
    (Descriptors without metadata: the form whose expansion needs no driver.)"""
    from triton.backends.nvidia import driver as nv

    calls = []

    def c_launch(*args):
        calls.append(args)

    signature = {"X_desc": "tensordesc<bf16[64, 128]>", "X": "*bf16", "n": "i32",
                 "BLOCK": "constexpr", "Y_desc": "tensordesc<bf16[64, 128]>", "Z": "*fp32"}

    class Run:  # CudaLauncher's attributes and call, as in Triton 3.6
        launch = staticmethod(nv.wrap_handle_tensordesc(c_launch, signature, None))
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def __call__(self, gx, gy, gz, stream, function, *args):
            self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid,
                        self.launch_pdl, None, None, *args)

    class Compiled:
        run, function, packed_metadata = Run(), 77, ("packed",)

    assert launch._raw_launch(Compiled.run) == (c_launch, [None, None], frozenset({0, 4}))
    monkeypatch.setattr(launch, "_current_stream", lambda device: 1234)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_hooks", lambda: (None, None))

    def desc(t):
        return launch.Desc(t, tuple(t.shape), tuple(t.stride()), (64, 128), "layout")

    x0, y, z0 = torch.randn(256, 128), torch.randn(128, 128), torch.randn(8)
    bound = launch.bound_launch(Compiled(), (5, 2), [desc(x0), x0, 300, 64, desc(y), z0],
                                (1, 5), 0)
    x1, z1 = torch.randn(256, 128), torch.randn(8)
    assert bound(x1.data_ptr(), z1.data_ptr())
    # Triton's own launch of the same call: the descriptors as bound, x1 / z1 in the slots
    Compiled.run(5, 2, 1, 1234, 77, ("packed",), None, None, None,
                 desc(x0), x1, 300, 64, desc(y), z1)
    # a descriptor slot too (X_desc: encoded at each call's base, its fields kept)
    both = launch.bound_launch(Compiled(), (5, 2), [desc(x0), x0, 300, 64, desc(y), z0],
                               (0, 1, 5), 0)
    assert both(x1.data_ptr(), x1.data_ptr(), z1.data_ptr())
    Compiled.run(5, 2, 1, 1234, 77, ("packed",), None, None, None,
                 desc(x1), x1, 300, 64, desc(y), z1)

    def flat(args):  # (tensors as the addresses the C launcher reads)
        return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)

    assert len(calls) == 4, calls
    assert flat(calls[0]) == flat(calls[1]) and flat(calls[2]) == flat(calls[3]), calls
    assert flat(calls[2]) != flat(calls[0])  # (X_desc's base moved)
    assert len(calls[0]) == 13 + (1 + 2 + 2 + 1 + 2 + 2) * 2 + 4  # (two decomposed descriptors)
    # a descriptor slot's encoding is kept by base address: a base seen before is not encoded
    # again, and its launch passes what Triton's does
    encoded = []
    real_encode = launch._encode
    monkeypatch.setattr(launch, "_encode", lambda d, m: encoded.append(d.base) or real_encode(d, m))
    for x in (x1, x0, x1, x0):
        assert both(x.data_ptr(), x.data_ptr(), z1.data_ptr())
        Compiled.run(5, 2, 1, 1234, 77, ("packed",), None, None, None,
                     desc(x), x, 300, 64, desc(y), z1)
    assert encoded == [x0.data_ptr()], encoded  # (x1's from the call above)
    assert all(flat(calls[i]) == flat(calls[i + 1]) for i in range(4, 12, 2)), calls[4:]
    monkeypatch.setattr(launch, "ENCODED_PER_BOUND", 1)  # a full cache starts again
    x2 = torch.randn(256, 128)
    for x in (x2, x1):
        assert both(x.data_ptr(), x.data_ptr(), z1.data_ptr())
    assert encoded == [x0.data_ptr(), x2.data_ptr(), x1.data_ptr()], encoded


def test_kept_launches_repeat_by_key(fast, monkeypatch):
    """``Launcher.bind_kept`` launches through the launcher and keeps the ``Bound`` under the
    caller's key; ``launch.repeat`` calls it with the slot values and says whether it launched
    (no entry, or a Bound that steps aside: False, the caller launches the plain way); a launch
    that cannot be bound keeps nothing."""
    kernel, lau = fast
    calls = []

    class Recorder:
        def __init__(self, answer):
            self.answer = answer

        def __call__(self, *values):
            calls.append(values)
            return self.answer

    made = iter([Recorder(True), Recorder(False), None])
    monkeypatch.setattr(launch, "bound_launch", lambda *a: next(made))
    cache, x = {}, torch.randn(4, 8)
    assert not launch.repeat(cache, "a", 1) and not calls
    lau.bind_kept(cache, "a", (2,), (x, 3, 8), dict(BLOCK=16), (0,))
    assert len(kernel.plain) == 1 and list(cache) == ["a"]
    assert launch.repeat(cache, "a", 99) and calls == [(99,)]
    lau.bind_kept(cache, "b", (2,), (x, 3, 8), dict(BLOCK=16), (0,))
    assert not launch.repeat(cache, "b", 7) and calls[-1] == (7,)  # (stepped aside)
    lau.bind_kept(cache, "c", (2,), (x, 3, 8), dict(BLOCK=16), (0,))
    assert "c" not in cache and not launch.repeat(cache, "c", 5)

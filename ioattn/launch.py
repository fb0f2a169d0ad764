"""Kernel launches without Triton's per-call argument binding, for repeated calls.

``kernel[grid](*args, **constexprs)`` binds every call's arguments anew before Triton finds its
compiled kernel: a Python binder, a C++ specialization of each argument, a cache key, launch
metadata, and for each TMA descriptor a dataclass whose checks run in Python. On the H200
machine that is a large part of an attention call's 200-400 us of host time, more than a short
causal problem's kernel (benchmarks/NOTES.md, session 9). ``launcher(kernel)[grid](...)`` takes
the same arguments and keeps, per *signature*, the ``CompiledKernel`` that Triton's own call
returned the first time; later calls with that signature go straight to its launcher.

The signature is a superset of what Triton specializes on, so two calls that share one would
also share Triton's compiled kernel: each tensor's dtype and 16-byte alignment; each int's
width (32 / 64 bits, unsigned past 2**63), whether it is 1 and whether 16 divides it, as
Triton's specialization (so sequence lengths that change from call to call keep one entry);
each float as a float; each constexpr's value (positional or keyword) and each bool's; each TMA
descriptor's block shape, layout, shape, strides, base dtype and base alignment; the other
keyword arguments (``num_warps``...) by value; and the current device.
Descriptors are passed as ``Desc`` (plain fields, no checks: the first call of a signature runs
Triton's checks on the real descriptor, and the checked properties are in the signature).

Launch hooks (Proton, ``knobs.runtime.launch_enter_hook``) get what Triton's call gives them;
Triton's debug and instrumentation switches are part of the signature. Not repeated per call:
Triton's check that the kernel's global variables have not changed since it compiled (this
library's kernels read constant globals only) and its pre-run hooks (none are registered).
The plain path is taken under the interpreter, for an argument of a type outside the signature's
(then Triton binds it), and for anything that is not a Triton/Gluon ``JITFunction`` returning a
``CompiledKernel``.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from triton import knobs
from triton.runtime.driver import driver

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_MAX_ENTRIES = 256  # signatures kept per cache (a new one past this clears it)


def keep(cache: dict, key, value, size: int = _MAX_ENTRIES):
    """cache[key] = value in a per-signature cache of at most ``size`` entries (a new one past
    that clears it: signatures of one program are few, a cache that fills is churning); returns
    value. The kernels' caches here and the dense entry points' memos (``dense.api._PLANS``,
    ``dense.op._MEMO``) all keep their entries through it."""
    if len(cache) >= size:
        cache.clear()
    cache[key] = value
    return value


class Desc:
    """A host TMA descriptor's fields (gluon's ``TensorDescriptor`` without its checks)."""

    __slots__ = ("base", "shape", "strides", "block_shape", "layout", "padding")

    def __init__(self, base: torch.Tensor, shape, strides, block_shape, layout) -> None:
        self.base, self.shape, self.strides = base, shape, strides
        self.block_shape, self.layout, self.padding = block_shape, layout, "zero"

    def real(self):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides),
                                list(self.block_shape), self.layout)


def _tensor_sig(t: torch.Tensor):
    return t.dtype, t.data_ptr() % 16 == 0


def _desc_sig(d: Desc):
    b = d.base
    return ("desc", b.dtype, b.data_ptr() % 16 == 0, tuple(d.shape), tuple(d.strides),
            tuple(d.block_shape), d.layout)


def _value_sig(x):
    return type(x), x


def _int_sig(x: int):
    """What Triton specializes a (non-constexpr) int on: its width, == 1 (then a constant of
    the compiled kernel), and 16 | x (an alignment hint). Outside int64 / uint64 there is no
    key: Triton's call refuses the value (its launcher would wrap a u64 silently)."""
    if not -2**63 <= x < 2**64:
        raise KeyError(x)
    width = 0 if -2**31 <= x < 2**31 else (2 if x >= 2**63 else 1)
    return int, width, x == 1, x % 16 == 0


def _float_sig(x: float):
    return float  # fp32 whatever the value


def _float_value_sig(x: float):
    return float, repr(x)  # (a constexpr: 0.0 and -0.0 are equal, but compile apart)


# by value: constexpr parameters and keyword launch options; _SPEC: the other parameters
_SIG = {torch.Tensor: _tensor_sig, torch.nn.Parameter: _tensor_sig, Desc: _desc_sig,
        int: _value_sig, bool: _value_sig, float: _float_value_sig, str: _value_sig,
        type(None): _value_sig, torch.dtype: _value_sig}
_SPEC = {**_SIG, int: _int_sig, float: _float_sig}


def _hooks():
    """Triton's launch hooks (Proton, torch's profiler annotations), passed on as its call does.
    Triton 3.6 defaults them to empty ``HookChain``s, which call nothing: those become None, as
    no hook, so the launch builds no metadata for them (what the launcher does with None)."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return _live(enter), _live(leave)


def _live(hook):
    return None if hook is None or getattr(hook, "calls", None) == [] else hook


def _knobs():
    """The Triton switches its own call adds to its kernel cache key on every call (debug mode,
    instrumentation such as ConSan): a kernel kept under one is not launched under another."""
    return knobs.runtime.debug, knobs.compilation.instrumentation_mode


def _current_device() -> int:
    return driver.active.get_current_device()


def current_stream(device: int) -> int:
    """The current CUDA stream's handle on ``device`` (an index), as Triton's launch reads it."""
    return driver.active.get_current_stream(device)


_current_stream = current_stream


def _is_jit_function(kernel) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(kernel, JITFunction)


class Launcher:
    """``launcher(kernel)[grid](*args, **kwargs)``: as ``kernel[grid](...)`` (see the module)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.cache: dict = {}
        self.names = list(getattr(kernel, "arg_names", ()))
        params = getattr(kernel, "params", ())
        self.defaults = {p.name: p.default for p in params if p.has_default}
        # each parameter's signature table: constexprs by value, the others as Triton
        # specializes them (params and arg_names are both in the kernel's parameter order)
        self.tables = {p.name: _SIG if getattr(p, "is_constexpr", False) else _SPEC
                       for p in params}
        self.pos_tables = [self.tables.get(n, _SIG) for n in self.names]
        # plain JIT functions only: an Autotuner / Heuristics wrapper runs its own hooks per call
        self.fast = not _INTERPRET and _is_jit_function(kernel) and bool(self.names)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _plain(self, grid, args, kwargs):
        args = tuple(a.real() if type(a) is Desc else a for a in args)
        kwargs = {k: v.real() if type(v) is Desc else v for k, v in kwargs.items()}
        return self.kernel[grid](*args, **kwargs)

    def _launch(self, grid, args, kwargs):
        if not self.fast or len(args) > len(self.names):
            return self._plain(grid, args, kwargs)
        device = _current_device()
        try:
            key = (device, _knobs(),
                   tuple(t[type(a)](a) for t, a in zip(self.pos_tables, args)),
                   tuple((k, self.tables.get(k, _SIG)[type(v)](v)) for k, v in kwargs.items()))
        except KeyError:  # an argument of another type: Triton binds it
            return self._plain(grid, args, kwargs)
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self._plain(grid, args, kwargs)
            ok = all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
            keep(self.cache, key, compiled if ok else False)
            return compiled
        if compiled is False:  # not a CompiledKernel: Triton's call each time
            return self._plain(grid, args, kwargs)
        # the launcher takes every parameter in order (the constexprs' values too, which it skips)
        tail = self._tail(args, kwargs)
        if tail is None:  # a parameter without a value: Triton's call says which
            return self._plain(grid, args, kwargs)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = _current_stream(device)
        enter, leave = _hooks()
        meta = (None if enter is None and leave is None
                else compiled.launch_metadata(grid, stream, *args, *tail))
        compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, meta,
                     enter, leave, *args, *tail)
        return compiled


    def _tail(self, args, kwargs):
        """The parameters after the positional ``args``, in order, from ``kwargs`` or their
        defaults (None when one has neither)."""
        try:
            return [kwargs[n] if n in kwargs else self.defaults[n] for n in self.names[len(args):]]
        except KeyError:
            return None

    def bind(self, grid, args, kwargs, slots) -> Optional["Bound"]:
        """Launch as ``self[grid](*args, **kwargs)``, and return a ``Bound`` that repeats this
        launch with new tensors in the positional parameters ``slots`` only (None where the
        launch cannot be bound: the plain path, a kernel with scratch memory, or Triton's
        launcher not in the form ``_raw_launch`` knows). The caller keys the Bound on
        everything the other arguments derive from (every pointer among them included)."""
        compiled = self._launch(grid, args, kwargs)
        tail = self._tail(args, kwargs)
        if not self.fast or tail is None or _hooks() != (None, None):
            return None  # (with launch hooks set, launches must go through Triton's call)
        return bound_launch(compiled, grid, list(args) + tail, slots, _current_device())


    def bind_kept(self, cache: dict, key, grid, args, kwargs, slots) -> Optional["Bound"]:
        """Launch as ``self[grid](*args, **kwargs)`` and keep its ``Bound`` (``bind``) in
        ``cache`` under ``key``, for ``repeat`` to find: the caller's key holds everything the
        arguments derive from but the ``slots``' values. Returns the Bound (or None)."""
        bound = self.bind(grid, args, kwargs, slots)
        if bound is not None:
            keep(cache, key, bound)
        return bound


def repeat(cache: dict, key, *values) -> bool:
    """Launch ``cache``'s kept ``Bound`` under ``key`` (``Launcher.bind_kept``) with these slot
    values; False (nothing launched) when there is none or it steps aside (``Bound``): the
    caller then builds its arguments and launches through ``bind_kept``."""
    bound = cache.get(key)
    return bound is not None and bound(*values)


def bound_launch(compiled, grid, params: list, slots, device: int) -> Optional["Bound"]:
    """(``Launcher.bind``) The ``Bound`` of a launch of ``compiled`` on ``grid`` with every
    parameter's value in order (``params``, constexprs included) and ``slots`` (indices into
    params) left to each call; None where it cannot be bound (no C launcher in the form
    ``_raw_launch`` knows, scratch memory, not a CompiledKernel)."""
    if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    run = compiled.run
    found = _raw_launch(run)
    if found is None or getattr(run, "global_scratch_size", 1) \
            or getattr(run, "profile_scratch_size", 1):
        return None
    raw, desc_meta, desc_positions = found
    flat, where = [], {}
    metas = iter(desc_meta)
    for i, a in enumerate(params):
        if i in desc_positions:  # a TMA descriptor, encoded once (its base pointer included)
            meta = next(metas)
            args = _encode(a, meta)
            # (a slot's descriptor: its fields kept, to encode at each call's base address)
            where[i] = (len(flat), len(args), _At(a, 0), meta)
            flat.extend(args)
            continue
        where[i] = len(flat)
        # tensors as their addresses: the Bound keeps no tensor (its memory) alive
        flat.append(a.data_ptr() if isinstance(a, torch.Tensor) else a)
    head = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            compiled.function, run.launch_cooperative_grid, run.launch_pdl,
            compiled.packed_metadata)
    return Bound(raw, head, flat, tuple(where[i] for i in slots), device, _knobs())


class _Ptr(int):
    """An address with a tensor's ``data_ptr`` (what Triton's descriptor encoding reads)."""

    def data_ptr(self) -> int:
        return int(self)


class _At:
    """A TMA descriptor's fields (a ``Desc`` or gluon's ``TensorDescriptor``) over another
    base address: a ``Bound``'s descriptor slot, encoded at each call's address."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, desc, address: int) -> None:
        self.base, self.shape, self.strides = _Ptr(address), desc.shape, desc.strides
        self.padding = desc.padding


# a ``Bound``'s kept descriptor encodings (all slots together) before it forgets them
ENCODED_PER_BOUND = 64


class Bound:
    """One launch kept with its arguments flattened as Triton's C launcher takes them (TMA
    descriptors encoded, tensors as addresses), so a repeat is one C call: ``Launcher.bind``.
    Calling it with a value for each bound slot (a pointer parameter's: an address or tensor;
    a descriptor's: the base address, its shape, strides and box kept from the bind) launches
    on the current stream, or returns False (nothing launched) when Triton's launch hooks, its
    switches or the current device changed since: the caller then launches the plain way."""

    __slots__ = ("raw", "head", "flat", "slots", "device", "knobs", "encoded")

    def __init__(self, raw, head, flat, slots, device, knobs_) -> None:
        self.raw, self.head, self.flat, self.slots = raw, head, flat, slots
        self.device, self.knobs = device, knobs_
        # (descriptor position, base address) -> its encoded arguments: a descriptor is its
        # slot's fixed fields over the base, so a base seen before (the caching allocator hands
        # the same blocks to a loop's fresh tensors) is not encoded again
        self.encoded: dict = {}

    def __call__(self, *values) -> bool:
        if _hooks() != (None, None) or _knobs() != self.knobs \
                or _current_device() != self.device:
            return False
        flat = self.flat.copy()
        for slot, value in zip(self.slots, values):
            if type(slot) is tuple:  # a descriptor: encoded at this call's base address
                at, width, fields, meta = slot
                args = self.encoded.get((at, value))
                if args is None:
                    args = keep(self.encoded, (at, value), _encode(_At(fields, value), meta),
                                ENCODED_PER_BOUND)
                flat[at:at + width] = args
            else:
                flat[slot] = value
        gx, gy, gz, function, coop, pdl, packed = self.head
        self.raw(gx, gy, gz, _current_stream(self.device), function, coop, pdl, None, None,
                 packed, None, None, None, *flat)
        return True


def _raw_launch(run):
    """(C launch function, TMA descriptor metadata, descriptor parameter positions) of a
    Triton 3.6 ``CudaLauncher``: its ``launch`` is the C function itself, or the closure
    ``wrap_handle_tensordesc`` puts around it (which encodes each descriptor per call). None
    for any other form."""
    from triton.backends.nvidia import driver as nvidia_driver

    launch = getattr(run, "launch", None)
    # (the base arguments ``Bound`` passes: grid, stream, function, cooperative, PDL, the two
    # scratch buffers, packed metadata, launch metadata and the two hooks)
    if launch is None or getattr(nvidia_driver, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO":
        return None
    if type(launch).__name__ == "builtin_function_or_method":
        return launch, [], frozenset()
    code = getattr(launch, "__code__", None)
    if code is None or not launch.__qualname__.startswith("wrap_handle_tensordesc.") \
            or launch.__closure__ is None:
        return None
    cells = {n: c.cell_contents for n, c in zip(code.co_freevars, launch.__closure__)}
    raw, meta, positions = (cells.get(n) for n in ("launcher", "tensordesc_meta",
                                                    "tensordesc_indices"))
    if raw is None or meta is None or positions is None or not callable(raw):
        return None
    return raw, list(meta), frozenset(positions)


def _encode(desc, meta) -> list:
    """A descriptor parameter's arguments to the C launcher (as Triton's per-call wrapper
    makes them), tensors among them (the decomposed form's base) as addresses."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return [int(x.data_ptr()) if hasattr(x, "data_ptr") else x
            for x in make_tensordesc_arg(desc, meta)]


def launcher(kernel) -> Launcher:
    """The ``Launcher`` of ``kernel`` (one per kernel object, kept on it)."""
    got = getattr(kernel, "_ioattn_launcher", None)
    if got is None:
        got = Launcher(kernel)
        try:
            kernel._ioattn_launcher = got
        except AttributeError:
            pass
    return got

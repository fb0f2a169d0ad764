"""The L2 promotion of TMA descriptors (``IOATTN_TMA_L2``; opt-in, process-wide).

Triton 3.6 encodes every host TMA descriptor with ``CU_TENSOR_MAP_L2_PROMOTION_L2_128B``: an L2
miss through the descriptor fetches 128 bytes. A decode kernel that reads each KV head's slice
of a page as rows of 256 B (NHD, page 16, d=128) issues two such fetches a row. With
``IOATTN_TMA_L2=256`` (or ``64`` / ``none``) the first launch through ``ioattn.launch`` wraps
Triton's descriptor encoder (``driver.active.utils.fill_tma_descriptor``): each descriptor
Triton encodes is encoded again in place by the driver's ``cuTensorMapEncodeTiled`` with the
same fields and the requested promotion. It applies to every Triton TMA descriptor the process
encodes from then on (ioattn's and any other library's), which is why it is a switch, not a
default. Before wrapping, one descriptor is encoded both ways at Triton's own promotion and
compared byte for byte; a mismatch (another Triton layout) raises instead of launching with a
descriptor of unknown form.
"""
from __future__ import annotations

import ctypes
import os

PROMOTIONS = {"none": 0, "64": 1, "128": 2, "256": 3}
TRITON_DEFAULT = "128"  # (driver.c: CU_TENSOR_MAP_L2_PROMOTION_L2_128B)

_setting = os.environ.get("IOATTN_TMA_L2", TRITON_DEFAULT).lower().removesuffix("b")
if _setting not in PROMOTIONS:
    raise ValueError(f"IOATTN_TMA_L2={os.environ.get('IOATTN_TMA_L2')!r}: use one of "
                     f"{', '.join(PROMOTIONS)} (bytes an L2 miss through a TMA descriptor fetches)")
WANTED = _setting
_installed = WANTED == TRITON_DEFAULT  # nothing to do at Triton's own promotion

# offset of ``tensorMap`` in Triton's ``PyCUtensorMapObject`` (PyObject_HEAD, then the map
# aligned to 128 bytes)
_MAP_OFFSET = 128
_MAP_BYTES = 128


def _encode_fn():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                   u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def _reencode(fn, desc, promotion: int, address, swizzle, elem_size, elem_type, block, shape,
              strides, padding) -> None:
    """Encode ``desc`` (a Triton ``PyCUtensorMap``) again in place, as driver.c's
    ``fill_tma_descriptor`` does but with ``promotion``."""
    rank = len(block)
    box = (ctypes.c_uint32 * 5)(*[int(b) for b in reversed(list(block))])
    dims = (ctypes.c_uint64 * 5)(*[int(s) for s in reversed(list(shape))])
    # byte strides of every dimension but the innermost, innermost-next first
    steps = (ctypes.c_uint64 * 5)(*[elem_size * int(s) for s in reversed(list(strides)[:-1])])
    ones = (ctypes.c_uint32 * 5)(1, 1, 1, 1, 1)
    fill = 1 if padding == 1 else 0  # NAN_REQUEST_ZERO_FMA / NONE, as driver.c
    res = fn(id(desc) + _MAP_OFFSET, elem_type, rank, address, dims, steps, box, ones, 0,
             swizzle, promotion, fill)
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({res}) re-encoding a TMA descriptor "
                           f"for IOATTN_TMA_L2={WANTED}: unset the switch")


def _self_check(fn, fill) -> None:
    """Encode one descriptor by Triton and again here at Triton's promotion: the bytes match
    or the wrapper is not installed."""
    import torch

    buf = torch.empty(64 * 128, dtype=torch.bfloat16, device="cuda")
    args = (buf.data_ptr(), 3, 2, 9, [16, 64], [64, 128], [128, 1], 0)  # bf16, 128B swizzle
    desc = fill(*args)
    before = ctypes.string_at(id(desc) + _MAP_OFFSET, _MAP_BYTES)
    _reencode(fn, desc, PROMOTIONS[TRITON_DEFAULT], *args)
    after = ctypes.string_at(id(desc) + _MAP_OFFSET, _MAP_BYTES)
    if before != after:
        raise RuntimeError("IOATTN_TMA_L2: this Triton's TMA descriptor layout is not the one "
                           "ioattn.tma_l2 knows (3.6); unset the switch")


def install() -> None:
    """Wrap Triton's descriptor encoder once (a no-op at Triton's own promotion)."""
    global _installed
    if _installed:
        return
    from triton.runtime.driver import driver

    utils = driver.active.utils
    fill = utils.fill_tma_descriptor
    fn = _encode_fn()
    _self_check(fn, fill)
    promotion = PROMOTIONS[WANTED]

    def fill_tma_descriptor(address, swizzle, elem_size, elem_type, block, shape, strides,
                            padding):
        desc = fill(address, swizzle, elem_size, elem_type, block, shape, strides, padding)
        _reencode(fn, desc, promotion, address, swizzle, elem_size, elem_type, block, shape,
                  strides, padding)
        return desc

    fill_tma_descriptor.ioattn_l2 = WANTED
    fill_tma_descriptor.__wrapped_fill__ = fill
    utils.fill_tma_descriptor = fill_tma_descriptor
    _installed = True

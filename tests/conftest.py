"""Test setup: CPU runs the Triton kernels under the interpreter; outputs are poisoned before launch.

TRITON_INTERPRET must be set before triton is imported, so this runs before any ioattn import.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402


def _patch_interpreter_bf16_dot() -> None:
    """Triton 3.6-3.9's interpreter multiplies bf16 dot operands as their raw uint16 storage.

    Tests upcast them to fp32 (exact) first; kernels are left untouched.
    """
    from triton.runtime import interpreter

    orig = interpreter.InterpreterBuilder.create_dot
    if getattr(orig, "_ioattn_patched", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            def up(x):
                if x.dtype.scalar != tl.bfloat16:
                    return x.data.astype(np.float32)
                return (x.data.astype(np.uint32) << 16).view(np.float32)
            out = np.matmul(up(a), up(b), dtype=np.float32) + d.data
            return interpreter.TensorHandle(out.astype(d.data.dtype), d.dtype.scalar)
        return orig(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._ioattn_patched = True
    interpreter.InterpreterBuilder.create_dot = create_dot


def _patch_interpreter_bf16_rounding() -> None:
    """Triton 3.6's interpreter converts fp32 to bf16 by truncation (``x.to(tl.bfloat16)``,
    no rounding mode), where the GPU rounds to nearest even: in attention the truncated P
    biases every output slightly low, coherently across rows (the attention sink's gradient,
    a sum over rows, showed it). Tests round to nearest even, as the hardware does; kernels are
    left untouched."""
    from triton.runtime import interpreter

    orig = interpreter.InterpreterBuilder.cast_impl
    if getattr(orig, "_ioattn_patched", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rne = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            out = np.where(np.isnan(src.data), np.uint32(0x7FC0), rne).astype(np.uint16)
            return interpreter.TensorHandle(out, tl.bfloat16)
        return orig(self, src, dst_type)

    cast_impl._ioattn_patched = True
    interpreter.InterpreterBuilder.cast_impl = cast_impl


def _patch_interpreter_fp8_rounding() -> None:
    """Triton 3.6's interpreter converts fp32 to fp8 e4m3 (``x.to(tl.float8e4nv)``) without
    carrying a rounded-up mantissa into the exponent (31.2 becomes 16, not 32). Tests convert
    as the GPU's ``cvt.rn.satfinite.e4m3x2.f32`` does (nearest even, saturating at 448), through
    torch; kernels are left untouched."""
    from triton.runtime import interpreter

    orig = interpreter.InterpreterBuilder.create_fp_to_fp
    if getattr(orig, "_ioattn_patched", False):
        return

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            x = torch.where(x.isnan(), x, x.clamp(-448.0, 448.0))
            out = x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(out, tl.float8e4nv)
        return orig(self, src, dst_type, rounding_mode)

    create_fp_to_fp._ioattn_patched = True
    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_bf16_dot()
    _patch_interpreter_bf16_rounding()
    _patch_interpreter_fp8_rounding()

from ioattn.dense import op as _dense_op  # noqa: E402

_dense_op.POISON_OUTPUTS = True

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _fresh_memos():
    """Tests switch module-level knobs (sm90_fwd.WG3, SUPPORTED_HEAD_DIMS, preference rules)
    between calls of one shape: each starts and ends without the entry points' memoized
    per-signature decisions."""
    _dense_op.clear_memos()
    yield
    _dense_op.clear_memos()


if os.environ.get("IOATTN_TEST_SM90") == "always" and ON_GPU:
    # the whole dense suite through the sm90 kernels wherever they cover a call (auto otherwise
    # keeps short problems on the portable kernels, where they measured faster)
    from ioattn.dense import sm90_bwd as _sm90_bwd  # noqa: E402
    from ioattn.dense import sm90_fwd as _sm90_fwd  # noqa: E402

    _sm90_fwd.preferred = lambda *args: True
    _sm90_bwd.preferred = lambda *args: True


# ------------------------------------------------------------- sticky CUDA errors
# An illegal memory access (or another sticky CUDA error) leaves the process's CUDA context
# unusable: every later test of that pytest process fails with the same error, and one xdist
# worker's wall of failures hides which test caused it (session 13: 140 failures from one
# kernel). After such an error this process skips its remaining GPU tests, naming the test.
_STICKY = ("illegal memory access", "illegal instruction", "misaligned address",
           "unspecified launch failure", "device-side assert triggered", "invalid program counter",
           "hardware stack error")
_POISONED: list = []


def _poisons_context(exc: BaseException) -> bool:
    accel = getattr(torch, "AcceleratorError", None)
    msg = str(exc)
    return ((accel is not None and isinstance(exc, accel)) or "CUDA error" in msg) and any(
        s in msg for s in _STICKY)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if ON_GPU and report.failed and call.excinfo is not None and not _POISONED \
            and _poisons_context(call.excinfo.value):
        _POISONED.append(item.nodeid)


def pytest_runtest_setup(item):
    if _POISONED:
        pytest.skip(f"this process's CUDA context is unusable since {_POISONED[0]} failed with a "
                    f"sticky CUDA error (first failure: fix it, then rerun)")

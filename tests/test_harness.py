"""The test harness's own rules (tests/conftest.py)."""
from tests import conftest


def test_sticky_cuda_errors_are_recognized():
    """After an illegal memory access a process's CUDA context stays unusable, so conftest skips
    that process's later GPU tests, naming the first; errors a context survives are not such."""
    assert conftest._poisons_context(
        RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert conftest._poisons_context(RuntimeError("CUDA error: misaligned address"))
    assert conftest._poisons_context(
        RuntimeError("CUDA error: device-side assert triggered"))
    assert not conftest._poisons_context(RuntimeError("CUDA error: out of memory"))
    assert not conftest._poisons_context(AssertionError("out: max err 5.3e-01 > ..."))

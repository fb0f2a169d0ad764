"""Backend choice. An explicitly requested backend that cannot run raises; only 'auto' picks."""
from __future__ import annotations

import torch

from ioattn.dense.configs import interpreting

BACKENDS = ("auto", "triton", "reference")


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None when they can)."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"the Triton kernels need compute capability >= 8.0, {device} has {major}.x"
        return None
    if device.type == "cpu":
        if interpreting():
            return None
        return ("CPU tensors run only under the Triton interpreter: set TRITON_INTERPRET=1 before "
                "importing triton, or pass backend='reference'")
    return f"device type {device.type!r} is not supported (use CUDA tensors)"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map a requested backend to the one that runs: 'triton' or 'reference'."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "reference":
        return "reference"
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run: {reason}")
    return "triton"

"""ioattn: IO-aware attention kernels for NVIDIA GPUs in pure Python (torch + Triton).

Public API (FlashAttention-2 compatible): ``flash_attn_func``, ``flash_attn_varlen_func`` and their
packed variants, ``flash_attn_with_kvcache``; torch's SDPA call, ``scaled_dot_product_attention``;
FlashInfer's calls in ``ioattn.flashinfer``. Everything else is internal.

The API loads on first use, so ``python -m ioattn`` can choose the Triton interpreter on a CPU-only
machine before any kernel is defined (Triton fixes that choice when a kernel is decorated).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "scaled_dot_product_attention",
]
# where each public name lives (loaded on first use)
_HOMES = {name: "ioattn.dense.api" for name in __all__}
_HOMES["flash_attn_with_kvcache"] = "ioattn.decode.api"
_HOMES["scaled_dot_product_attention"] = "ioattn.dense.sdpa"

if TYPE_CHECKING:
    from ioattn.dense.api import (flash_attn_func, flash_attn_kvpacked_func,  # noqa: F401
                                  flash_attn_qkvpacked_func, flash_attn_varlen_func,
                                  flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
    from ioattn.decode.api import flash_attn_with_kvcache  # noqa: F401
    from ioattn.dense.sdpa import scaled_dot_product_attention  # noqa: F401


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ioattn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)

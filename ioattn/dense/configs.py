"""Tile configurations of the portable Triton kernels, chosen per architecture and head dim.

The GPU tables come from sweeps on an H200 (see benchmarks/NOTES.md); under the Triton interpreter
one small config keeps CPU tests fast and exercises BLOCK_M != BLOCK_N edge logic.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False  # K/V through device-side TMA descriptors (when strides/alignment allow)
    warp_specialize: bool = False  # tl.range(warp_specialize=True) on the unmasked loop (needs tma)


@dataclass(frozen=True)
class BwdConfig:
    block_m: int  # query rows per inner step of the dK/dV kernel
    block_n: int  # keys per program of the dK/dV kernel
    block_m_dq: int  # query rows per program of the dQ kernel
    block_n_dq: int  # keys per inner step of the dQ kernel
    num_warps: int
    num_stages: int
    keys_as_b: bool = False  # dK/dV kernel: K, V as wgmma B operands (shared memory, fewer registers)
    tma: bool = False  # Q/dO (dK/dV kernel) and K/V (dQ kernel) through TMA descriptors


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_PER_DEVICE: dict = {}  # (what, device type, index, interpreting) -> its answer


def per_device(what: str, device: torch.device, find):
    """``find(device)`` answered once per device (the capability, the SM count, whether the
    kernels can run: every call asks, and the driver's answers took ~10 us of host time each on
    the H200 machine), except while torch.compile traces."""
    if torch.compiler.is_compiling():
        return find(device)
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    key = (what, device.type, index, interpreting())
    if key not in _PER_DEVICE:
        _PER_DEVICE[key] = find(device)
    return _PER_DEVICE[key]


def capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, once per device (``per_device``)."""
    return per_device("capability", device,
                      lambda dev: tuple(torch.cuda.get_device_capability(dev)))


def pad_dim(d: int) -> int:
    """Head dims are padded to a power of two >= 16 inside the kernels (masked loads/stores)."""
    return max(16, 1 << (d - 1).bit_length())


_INTERP_FWD = FwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)
_INTERP_BWD = BwdConfig(block_m=32, block_n=64, block_m_dq=64, block_n_dq=32, num_warps=4, num_stages=1)


def fwd_config(device: torch.device, head_dim: int, head_dim_v: int, dtype: torch.dtype,
               masked: bool, seqlen_q: int) -> FwdConfig:
    if interpreting() or device.type != "cuda":
        return _INTERP_FWD
    return fwd_config_for(capability(device), head_dim, head_dim_v, masked,
                          seqlen_q, fp8=dtype == torch.float8_e4m3fn)


def fwd_config_for(arch: tuple[int, int], head_dim: int, head_dim_v: int, masked: bool,
                   seqlen_q: int, fp8: bool = False) -> FwdConfig:
    d = max(pad_dim(head_dim), pad_dim(head_dim_v))
    if arch[0] >= 9 and fp8:
        # the fp8 forward (K / V tiles half bf16's bytes): the sweep of benchmarks/tune.py
        # --mode fwd-fp8 on an H100, 2k and 16k (results/tune/tune_fp8_c718cc0_*.json)
        if d <= 64:
            return FwdConfig(128, 64, 4, 3, tma=True) if masked else FwdConfig(128, 64, 4, 3)
        if d <= 128:
            return (FwdConfig(128, 128, 8, 3, tma=True, warp_specialize=True) if masked
                    else FwdConfig(128, 128, 8, 3))
        return FwdConfig(128, 64, 8, 3)
    if arch[0] >= 9:
        # H200 sweeps, FA grid bf16 (benchmarks/NOTES.md). Causal work is uneven per query block,
        # so short causal problems want small query blocks; long ones want the TMA+WS pipeline.
        if d <= 64:
            return FwdConfig(64, 64, 4, 3) if masked else FwdConfig(128, 64, 4, 3)
        if d <= 128:
            if seqlen_q >= 8192:
                return FwdConfig(128, 128, 8, 3, tma=True, warp_specialize=True)
            if masked and seqlen_q <= 2048:
                return FwdConfig(64, 64, 4, 3)
            return FwdConfig(128, 64, 8, 3)
        return FwdConfig(128, 64, 8, 2)
    if d <= 64:
        return FwdConfig(128, 64, 4, 3)
    if d <= 128:
        return FwdConfig(128, 64, 8, 2)
    return FwdConfig(64, 64, 4, 2)


def bwd_config(device: torch.device, head_dim: int, head_dim_v: int, dtype: torch.dtype,
               masked: bool) -> BwdConfig:
    if interpreting() or device.type != "cuda":
        return _INTERP_BWD
    return bwd_config_for(capability(device), head_dim, head_dim_v, masked)


def bwd_config_for(arch: tuple[int, int], head_dim: int, head_dim_v: int, masked: bool) -> BwdConfig:
    d = max(pad_dim(head_dim), pad_dim(head_dim_v))
    # H200 sweep, s=8k bf16: d64 64x64 w4 377/344 TFLOP/s (causal); d128 64x128 w8 425/392.
    # Untuned below sm90 (same tables).
    if d <= 64:
        return BwdConfig(64, 64, 64, 64, 4, 3)
    if d <= 128:
        return BwdConfig(64, 128, 128, 64, 8, 3)
    return BwdConfig(32, 64, 64, 32, 8, 2)

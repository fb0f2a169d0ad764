"""IOATTN_TMA_L2: TMA descriptors encoded again with another L2 promotion. The argument
transformation and the switch's checks on the CPU; on sm90, the re-encoding itself (byte for
byte at Triton's promotion) and a forward and a paged decode under the switch in a fresh process."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ioattn import tma_l2
from ioattn.dispatch import sm90_unavailable_reason

ROOT = Path(__file__).resolve().parents[1]
SM90 = torch.cuda.is_available() and sm90_unavailable_reason(torch.device("cuda")) is None
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (H100/H200) with Triton 3.6.x")


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def test_bad_setting_names_the_switch():
    res = subprocess.run([sys.executable, "-c", "import ioattn.tma_l2"], env=_env(IOATTN_TMA_L2="300"),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "IOATTN_TMA_L2='300'" in res.stderr and "256" in res.stderr


def test_reencode_passes_the_driver_its_fields_innermost_first():
    got = {}

    def fake(addr, elem_type, rank, base, dims, strides, box, ones, interleave, swizzle, promo,
             fill):
        got.update(addr=addr, elem_type=elem_type, rank=rank, base=base, dims=list(dims)[:rank],
                   strides=list(strides)[:rank - 1], box=list(box)[:rank], ones=list(ones)[:rank],
                   interleave=interleave, swizzle=swizzle, promo=promo, fill=fill)
        return 0

    desc = object()
    # a 3-d view [pages, rows, cols] of bf16 (elem_size 2), box [1, 16, 64], NaN padding
    tma_l2._reencode(fake, desc, 3, 0x1000, 3, 2, 9, [1, 16, 64], [7, 32, 128],
                     [32 * 128 * 3, 128, 1], 1)
    assert got == dict(addr=id(desc) + 128, elem_type=9, rank=3, base=0x1000, dims=[128, 32, 7],
                       strides=[256, 32 * 128 * 3 * 2], box=[64, 16, 1], ones=[1, 1, 1],
                       interleave=0, swizzle=3, promo=3, fill=1)


def test_reencode_failure_names_the_switch():
    with pytest.raises(RuntimeError, match="IOATTN_TMA_L2"):
        tma_l2._reencode(lambda *a: 1, object(), 3, 0, 3, 2, 9, [16, 64], [64, 128], [128, 1], 0)


@needs_sm90
def test_reencoded_bytes_match_triton_at_its_promotion():
    from triton.runtime.driver import driver

    fill = driver.active.utils.fill_tma_descriptor
    fill = getattr(fill, "__wrapped_fill__", fill)
    fn = tma_l2._encode_fn()
    buf = torch.empty(4 * 64 * 128, dtype=torch.bfloat16, device="cuda")
    args = (buf.data_ptr(), 3, 2, 9, [1, 16, 64], [4, 64, 128], [64 * 128, 128, 1], 0)

    def raw(d):
        return ctypes.string_at(id(d) + 128, 128)

    desc = fill(*args)
    triton_bytes = raw(desc)
    tma_l2._reencode(fn, desc, tma_l2.PROMOTIONS["128"], *args)
    assert raw(desc) == triton_bytes
    tma_l2._reencode(fn, desc, tma_l2.PROMOTIONS["256"], *args)
    assert raw(desc) != triton_bytes
    tma_l2._reencode(fn, desc, tma_l2.PROMOTIONS["128"], *args)
    assert raw(desc) == triton_bytes


_SCRIPT = r"""
import torch, ioattn
from triton.runtime.driver import driver
from ioattn.reference import attention_ref
from ioattn.testing import assert_close_rule
torch.manual_seed(0)
q, k, v = (torch.randn(2, 203, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out = ioattn.flash_attn_func(q, k, v, causal=True, backend="sm90")
ref, _ = attention_ref(q, k, v, causal=True)
pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
assert_close_rule("out", out, ref, pt)
assert getattr(driver.active.utils.fill_tma_descriptor, "ioattn_l2", None) == "256"
# a planned paged decode (page 16, GQA 8 / 2, NHD) through the sm90 decode kernel
import ioattn.flashinfer as fi
from ioattn.decode import sm90_decode
from tests.paged.test_flashinfer import _check_request, _gather, _paged
calls, orig = [], sm90_decode.paged_decode_sm90
sm90_decode.paged_decode_sm90 = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
g = torch.Generator().manual_seed(1)
lens, indptr, indices, last, cache = _paged(4, 2, 128, 16, torch.bfloat16, "cuda", max_len=300, g=g)
w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                                          kv_layout="NHD")
w.plan(indptr, indices.cuda(), last, 8, 2, 128, 16, q_data_type=torch.bfloat16)
qd = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
out = w.run(qd, cache)
assert calls, "the sm90 decode kernel did not run"
for i, n in enumerate(lens):
    if n:
        kk, vv = _gather(cache, "NHD", indices, indptr, i, n)
        _check_request(f"out[{i}]", out[i:i + 1], qd[i:i + 1], kk, vv)
print("ok")
"""


@needs_sm90
def test_forward_and_decode_under_the_switch():
    res = subprocess.run([sys.executable, "-c", _SCRIPT], env=_env(IOATTN_TMA_L2="256"),
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]

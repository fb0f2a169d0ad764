"""The dense kernels compile for Hopper (sm90) with the instructions the design needs — on any
machine: Triton's wheel carries ptxas, so this runs in CPU-only CI as well."""
import json
import os
import subprocess
import sys


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "ioattn.dense.inspect", "--json"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    reports = {r["name"]: r for r in json.loads(res.stdout)}
    # fwd full/causal (bf16 and fp8) + dkdv + dq for d = 64, 128, 256
    assert len(reports) == 18
    for name, r in reports.items():
        assert r["wgmma"], f"{name}: no wgmma.mma_async in the PTX (slower mma path)"
        assert r["registers"] <= 255
        # the fp8 forward's Q·Kᵀ and P·V run as e4m3 wgmma (not converted to 16-bit first)
        assert r["fp8_wgmma"] == name.startswith("fp8"), name
    tma_fwd = [r for n, r in reports.items() if n.startswith("fwd d128")]
    assert tma_fwd and all(r["tma"] for r in tma_fwd), "d=128 forward should load K/V through TMA"


def test_sm90_fp8_forward_compiles():
    """The sm90 forward on fp8 q, k, v (``IOATTN_SM90_FP8``) compiles for Hopper at d = 64, 128,
    256, with and without a causal mask, with per-head and block descales, varlen causal,
    persistent, as FlashAttention-3's fp8 forward: every wgmma on e4m3 operands (QGMMA in the
    SASS; P·V's P from registers), TMA loads, register reallocation, and no spills in the key
    loop."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "ioattn.dense.inspect", "--gluon-fp8", "--json"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    reports = json.loads(res.stdout)
    assert len(reports) == 33, [r["name"] for r in reports]
    for r in reports:
        assert r["fp8_wgmma"] and r["wgmma"], f"{r['name']}: a wgmma not on e4m3 operands"
        assert r["sass"]["QGMMA"] > 0 and r["sass"]["HGMMA"] == 0, r["name"]
        assert r["sass"]["UTMALDG"] > 0 and r["sass"]["USETMAXREG"] > 0, r["name"]
        assert all(st + ld == 0 for _, st, ld in r["loops"]), r
        # (the persistent forms keep a tile's pointers across the tile loop: a few bytes, as
        # the 16-bit persistent forms)
        assert r["spill_stores"] <= (32 if "persistent" in r["name"] else 0), r
        assert r["shared_bytes"] <= 227 * 1024, r["name"]

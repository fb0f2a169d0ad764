"""The serving kernels compile for Hopper (sm90) with tensor-core MMAs and no spills, in the tile
configurations their launchers pick, and the K/V gather (a copy) without spills (on any machine:
Triton's wheel carries ptxas); the sm90 decode kernel (Gluon) with TMA loads, warp
specialization and at most 128 registers a thread."""
import os
import subprocess
import sys

SCRIPT = r"""
import json
from ioattn.decode import triton_decode as td
from ioattn.dense.inspect import kernel_report

ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", LSE="*fp32", O_PART="*fp32",
            LSE_PART="*fp32", SLOPES="*fp32", MASK="*u8")
base = dict(HEAD_DIM=128, BLOCK_D=128, PAGED=True, HAS_CACHE_IDX=False, HAS_LEFTPAD=False,
            HAS_LEFT=False, HAS_RIGHT=False, HAS_SOFTCAP=False, HAS_ALIBI=False, SPLIT=False,
            WORKLIST=False, CSR=False, LSE_BASE2=False, ROPE=False, BLOCK_HD=64, HAS_MASK=False)
out = []
for name, s_q, d, extra in [
        ("kvcache decode split", 1, 128, dict(SPLIT=True)),
        ("kvcache verify causal", 4, 128, dict(HAS_RIGHT=True, HAS_SOFTCAP=True, HAS_ALIBI=True)),
        ("paged decode", 1, 128, dict(WORKLIST=True, CSR=True, LSE_BASE2=True)),
        ("paged decode rope d256", 1, 256, dict(WORKLIST=True, CSR=True, LSE_BASE2=True, ROPE=True,
                                                BLOCK_HD=128)),
        ("paged prefill causal", 16, 128, dict(WORKLIST=True, CSR=True, LSE_BASE2=True,
                                               HAS_RIGHT=True)),
        ("paged prefill custom mask", 16, 128, dict(WORKLIST=True, CSR=True, LSE_BASE2=True,
                                                    HAS_MASK=True)),
        ("kvcache chunked prefill", 512, 128, dict(HAS_RIGHT=True)),
        ("paged prefill d256", 16, 256, dict(WORKLIST=True, CSR=True, LSE_BASE2=True,
                                             HAS_RIGHT=True)),
        ("paged decode fp8 kv", 1, 128, dict(WORKLIST=True, CSR=True, LSE_BASE2=True,
                                             _KV="*fp8e4nv"))]:
    kv = extra.pop("_KV", "*bf16")
    extras = any(extra.get(f) for f in ("HAS_SOFTCAP", "HAS_ALIBI", "ROPE", "HAS_MASK"))
    block_m, block_d, block_n = td.paged_tiles(4, d, s_q, extras)
    warps = td._attn_warps(block_m, block_d, extras)
    if "fp8" in kv:  # the planned launch's fp8 choices
        block_n, warps = td.worklist_launch(block_m, block_d, True, extras)
    ce = dict(base, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, **extra)
    r = kernel_report(name, td._kvcache_attn_kernel, dict(ptrs, K=kv, V=kv), ce, warps)
    out.append(r.__dict__)
for name, kv, d, paged in [("gather kv paged", "*bf16", 128, True),
                           ("gather kv contiguous fp8", "*fp8e4nv", 64, False)]:
    block_d = td._pow2(d, 16)
    r = kernel_report(name, td._gather_kv_kernel, dict(K=kv, V=kv, K_OUT="*bf16", V_OUT="*bf16"),
                      dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_R=4096 // block_d, PAGED=paged,
                           HAS_CACHE_IDX=not paged, HAS_LEFTPAD=True), 8, num_stages=1)
    out.append(r.__dict__)
from ioattn.dense.inspect import decode_gluon_report
from ioattn.dense.sm90_common import SOFTCAP_APPROX as APPROX
from ioattn.decode import sm90_decode as sd
sd.MMA16 = False  # (the wgmma forms first, whatever IOATTN_SM90_DECODE_MMA16 says; MMA16 below)
sd.EARLY = True  # (the default, whatever IOATTN_SM90_DECODE_EARLY says; its off forms below)
for d, page, merge, kv, bal, cap, pdl in (
        (128, 16, False, None, False, False, None), (64, 8, False, None, False, False, None),
        (128, 128, False, None, False, False, None), (128, 16, True, None, False, False, None),
        (64, 16, True, None, False, False, None), (128, 16, False, "fp8e4nv", False, False, None),
        (64, 8, False, "fp8e5", False, False, None), (128, 128, True, "fp8e4nv", False, False, None),
        (128, 16, True, None, True, False, None), (64, 8, True, "fp8e4nv", True, False, None),
        (128, 16, True, None, False, True, None), (128, 16, False, "fp8e4nv", False, True, None),
        (64, 8, True, "fp8e4nv", True, True, None), (128, 16, True, None, False, False, True),
        (64, 8, True, "fp8e4nv", True, True, True), (128, 16, True, None, False, False, "pf"),
        (64, 8, True, "fp8e4nv", False, True, "pf"), (128, 16, True, None, False, False, "pfc"),
        (64, 8, True, "fp8e4nv", False, True, "pfc"), (128, 16, True, None, False, False, "pfcs")):
    # the sm90 decode kernel (Gluon, TMA per page run; merge: split requests merged in the
    # kernel; kv: an fp8 cache, converted; bal: a balanced plan's columns, looped over; cap:
    # softcap's tanh on the scores; pdl: programmatic dependent launch, with the grid's axes
    # swapped too; "pf": and L2 prefetches before its wait, IOATTN_SM90_DECODE_PREFETCH; "pfc":
    # and the CTAs claiming their units, as on a graph's bound grid, IOATTN_SM90_DECODE_CLAIM;
    # "pfcs": an even subset of SMs claiming first, IOATTN_SM90_DECODE_CLAIM_SPREAD)
    on = None if pdl is None else True  # (None: as the environment sets them)
    r = decode_gluon_report(d, page, merge=merge, kv_dtype=kv, balanced=bal, softcap=cap,
                            pdl=on, heads_first=on, prefetch=pdl in ("pf", "pfc", "pfcs"),
                            claim="spread" if pdl == "pfcs" else pdl == "pfc")
    # (softcap's tanh on the MUFU: tanh.approx, unless IOATTN_SM90_SOFTCAP_APPROX=0)
    assert ("softcap" in r.name and APPROX) == (r.sass["MUFU.TANH"] > 0), r
    assert r.grid_dependency == (" pdl" in r.name), r
    assert (" prefetch" in r.name) == (pdl in ("pf", "pfc", "pfcs")), r
    assert (" claim" in r.name) == (pdl in ("pfc", "pfcs")), r
    assert (" spread" in r.name) == (pdl == "pfcs"), r
    assert (" early" in r.name) == (not bal), r  # (EARLY: one item a CTA only)
    assert r.tma and r.warp_specialized and r.registers <= 128, r  # two CTAs per SM
    out.append(r.__dict__)
for merge, kv, bal, cap in ((True, None, False, False), (False, "fp8e4nv", False, True),
                           (True, None, True, False)):
    # d=256 (IOATTN_SM90_DECODE_D256): compiled for 232 registers a thread, one CTA an SM
    r = decode_gluon_report(256, 16, merge=merge, kv_dtype=kv, balanced=bal, softcap=cap,
                            pdl=True, heads_first=True, prefetch=True)
    assert r.tma and r.warp_specialized and r.registers <= sd.MAXNREG_D256, r
    assert r.shared_bytes <= 232448 and all(st == ld == 0 for _, st, ld in r.loops), r
    out.append(r.__dict__)
sd.MMA16 = True  # the mma.sync consumer for groups <= 16 (IOATTN_SM90_DECODE_MMA16), its forms
for d, page, merge, kv, bal, cap in (
        (128, 16, True, None, False, False), (64, 8, False, None, False, False),
        (128, 16, True, "fp8e4nv", False, True), (128, 16, True, None, True, False),
        (64, 8, True, None, True, True), (128, 16, False, None, False, "cp")):
    if cap == "cp":  # (the cp.async producer, IOATTN_SM90_DECODE_LOADER=cpasync)
        sd.CP_ASYNC, cap = True, False
    r = decode_gluon_report(d, page, merge=merge, kv_dtype=kv, balanced=bal, softcap=cap,
                            pdl=True, heads_first=True, prefetch=True)
    r.name += " cp.async mma16" if sd.CP_ASYNC else " mma16"
    sd.CP_ASYNC = False
    assert r.sass["HMMA"] > 0 and r.sass["HGMMA"] == 0 and r.loops, r
    assert all(st == ld == 0 for _, st, ld in r.loops), r
    assert (r.tma or "cp.async" in r.name) and r.warp_specialized and r.registers <= 128, r
    assert r.shared_bytes <= 115712 or d < 128, r  # (two CTAs an SM, as the wgmma form)
    out.append(r.__dict__)
sd.MMA16 = False
sd.EARLY = False  # the item read after PDL's wait (IOATTN_SM90_DECODE_EARLY=0), its forms
for d, page, merge, kv, cap, pdl in (
        (128, 16, True, None, False, "pf"), (64, 8, True, "fp8e4nv", True, "pf"),
        (128, 16, True, None, False, "pfcs"), (128, 16, False, None, False, None)):
    on = pdl is not None
    r = decode_gluon_report(d, page, merge=merge, kv_dtype=kv, softcap=cap, pdl=on,
                            heads_first=on, prefetch=on, claim="spread" if pdl == "pfcs" else False)
    r.name += " late"
    assert " early" not in r.name and r.grid_dependency == on, r
    assert r.tma and r.warp_specialized and r.registers <= 128, r
    out.append(r.__dict__)
print(json.dumps(out))
"""


def test_serving_kernels_compile_for_sm90():
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for r in json.loads(res.stdout.strip().splitlines()[-1]):
        # compiled as the launcher specializes them (16-byte aligned pointers, strides that are
        # multiples of 16), every serving kernel in the configuration its launcher picks is
        # spill-free; the attention tiles run on the tensor cores (the gather is a copy)
        assert r["spill_stores"] == 0, f"{r['name']}: {r['spill_stores']} B of spills"
        assert r["name"].startswith("gather kv") or r["wgmma"] or r["name"].endswith(" mma16"), \
            f"{r['name']}: no tensor-core MMA"

"""Compile the dense kernels for a GPU target without a GPU; report instructions, registers, spills.

    python -m ioattn.dense.inspect            # table for sm90 (H100/H200), bf16
    python -m ioattn.dense.inspect --json

Runs on a CPU-only machine (Triton's wheel carries ptxas and cuobjdump): CI uses it to prove the
kernels build for Hopper with the instructions the design needs (wgmma, TMA bulk copies), and
tuning uses the spill counts to screen tile configs before spending GPU time. Must run without
TRITON_INTERPRET=1 (interpreted kernels cannot be compiled).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ioattn.dense import triton_bwd, triton_fwd

_PTR_TYPES = {"LSE": "*fp32", "DELTA": "*fp32", "DLSE": "*fp32", "SLOPES": "*fp32",
              "CU_Q": "*i32", "CU_K": "*i32", "RNG": "*i64", "QD": "*fp32", "KD": "*fp32",
              "VD": "*fp32"}
_INT_PREFIXES = ("stride", "n_heads", "kv_group", "seqlen", "rng_rows", "max_seqlen", "window",
                 "qd_group")


def _signature(fn, constexprs: dict, dtype: str) -> dict:
    """dtype: the operands' ("fp8e4nv": fp8 q, k, v with a bf16 O, as the fp8 forward)."""
    sig = {}
    for prm, name in zip(fn.params, fn.arg_names):
        if name in constexprs or prm.is_constexpr:  # (constexprs not given: their defaults)
            sig[name] = "constexpr"
        elif name.isupper():  # pointer arguments are the upper-case names
            sig[name] = _PTR_TYPES.get(name, "*bf16" if name == "O" and dtype == "fp8e4nv"
                                       else f"*{dtype}")
        elif name.startswith(_INT_PREFIXES):
            sig[name] = "i32"
        else:
            sig[name] = "fp32"
    return sig


def _launch_attrs(fn, sig: dict, constexprs: dict | None = None) -> dict:
    """The divisibility Triton's launcher specializes on at run time: pointers 16-byte aligned
    and strides multiples of 16 elements, as for contiguous tensors with d a multiple of 16 (the
    launcher marks any int argument divisible by 16). Without them the compile is not the one
    the GPU runs: loads are not vectorized, cp.async pipelining is off, and register counts and
    spills differ (the decode kernels spilled 0.4-2.5 KB compiled without them, none with).
    With the kernel's constexprs (the dense Gluon kernels, ``_gluon_compile``): every int
    argument as in the FlashAttention grid's launches (``_GRID_INTS_UNALIGNED``)."""
    def divisible(n: str) -> bool:
        if sig.get(n, "").startswith("*") or n.startswith("stride_"):
            return True
        if constexprs is None or sig.get(n) not in ("i32", "i64"):
            return False
        if n == "window_right":  # 0 under a causal mask, a user's value with a window
            return bool(constexprs.get("HAS_RIGHT")) and not constexprs.get("HAS_LEFT")
        return n not in _GRID_INTS_UNALIGNED
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if divisible(n)}


# The dense Gluon kernels' int arguments as the FlashAttention grid launches them (16k tokens,
# hidden 2048: sequence lengths 512..16k, 8-32 heads, batch x heads, the block table's width 0),
# which Triton's launcher specializes: a multiple of 16 is marked divisible by 16 (these
# hints moved ptxas's spills by up to 700 B either way, session 21), except the names here:
# window_left (-1 or a user's), the grouped order's head group (1 is a constexpr at launch; the
# "lpt" jobs compile the runtime value). kv_group is 1 there (no GQA): ``gluon_jobs``
# makes it the constexpr the launcher does. (d=256's 8 heads are not a multiple of 16; marked
# with the rest.)
_GRID_INTS_UNALIGNED = ("window_left", "head_group")


@dataclass
class KernelReport:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    wgmma: bool
    tma: bool
    warp_specialized: bool
    mbarrier_waits: int = 0
    shared_bytes: int = 0
    sass: dict | None = None  # SASS opcode counts of interest (Gluon kernels), from cuobjdump
    tma_reduce: bool = False  # cp.reduce.async.bulk.tensor (TMA reduce-add) in the PTX
    grid_dependency: bool = False  # griddepcontrol.wait (programmatic dependent launch) in the PTX
    fp8_wgmma: bool = False  # wgmma.mma_async on e4m3 operands (the fp8 forward) in the PTX
    # (Gluon kernels) each innermost loop that issues wgmma (a step / key-block loop), in code
    # order: [instructions, spill stores (STL), spill loads (LDL)] an iteration (``loop_spills``)
    loops: list | None = None

    def row(self) -> str:
        worst = max((st + ld for _, st, ld in self.loops or ()), default=0)
        return (f"{self.name:58s} regs {self.registers:3d}  spill st/ld {self.spill_stores:5d}/"
                f"{self.spill_loads:5d}  wgmma {'y' if self.wgmma else 'n'}  tma {'y' if self.tma else 'n'}"
                f"  setmaxnreg {'y' if self.warp_specialized else 'n'}"
                + (f"  loop spill ops {worst}" if self.loops is not None else ""))


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    # the ptxas Triton itself compiles with (TRITON_PTXAS_PATH may point at a CUDA toolkit's, whose
    # PTX version the wheel's bundled ptxas cannot read)
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", path, "-o", path + ".o"],
                             capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{ptxas} failed ({res.returncode}): {res.stderr[-2000:]}")
    text = res.stderr

    def num(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    return (num(r"Used (\d+) registers"), num(r"(\d+) bytes spill stores"),
            num(r"(\d+) bytes spill loads"))


SASS_OPS = ("HGMMA", "QGMMA", "HMMA", "UTMALDG", "UTMASTG", "USETMAXREG", "SYNCS", "WARPGROUP",
            "MUFU")


def _sass_counts(text: str) -> dict:
    """Counts of the Hopper SASS opcodes in SASS_OPS in a kernel's SASS (``_sass_text``):
    HGMMA (async warpgroup MMA; QGMMA on fp8 operands), HMMA (mma.sync), UTMALDG/UTMASTG (TMA),
    USETMAXREG (register reallocation), SYNCS (mbarrier ops); and MUFU.TANH (softcap's
    tanh.approx) among the MUFU ops."""
    # (addresses grow past four hex digits in kernels over 64 KB of code)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text)
    return {**{op: ops.count(op) for op in SASS_OPS}, "MUFU.TANH": text.count("MUFU.TANH")}


def loop_spills(text: str) -> list[list[int]]:
    """The innermost loops of a kernel's SASS that issue tensor-core MMAs (HGMMA / QGMMA, wgmma
    on 16-bit / fp8 operands, or HMMA, mma.sync: the step / key-block loops), each as [instructions, STL, LDL] an
    iteration, in code order. A loop is a backward branch's span; innermost, one holding no
    other. Spills outside them (a prologue, an epilogue, a persistent kernel's per-tile code)
    cost once, these every iteration."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    spans = set()
    for addr, op in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            spans.add((int(m.group(1), 16), addr))
    out = []
    for lo, hi in sorted(spans):
        if any(o != (lo, hi) and lo <= o[0] and o[1] <= hi for o in spans):
            continue
        body = [op for addr, op in ins if lo <= addr <= hi]
        if any(re.search(r"\b(?:HG?MMA|QGMMA)\b", op) for op in body):  # (QGMMA: fp8 operands)
            out.append([len(body), sum(bool(re.search(r"\bSTL\b", op)) for op in body),
                        sum(bool(re.search(r"\bLDL\b", op)) for op in body)])
    return out


def _sass_text(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([tool, "-sass", path], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{tool} failed ({res.returncode}): {res.stderr[-2000:]}")
    return res.stdout


def compile_report(name: str, fn, constexprs: dict, num_warps: int, num_stages: int,
                   arch: int = 90, dtype: str = "bf16") -> KernelReport:
    # constexprs not given take their defaults, as at a launch
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default},
                  **constexprs}
    sig = _signature(fn, constexprs, dtype)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=_launch_attrs(fn, sig))
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = k.asm["ptx"]
    regs, st, ld = _ptxas_usage(ptx, arch)
    return KernelReport(name, regs, st, ld, wgmma="wgmma.mma_async" in ptx,
                        tma="cp.async.bulk.tensor" in ptx, warp_specialized="setmaxnreg" in ptx,
                        fp8_wgmma=_all_fp8_wgmma(ptx))


def _all_fp8_wgmma(ptx: str) -> bool:
    """Whether the PTX has wgmma and every one of them takes e4m3 operands (the fp8 forward's
    Q·Kᵀ and P·V both on fp8 tensor cores, none converted to 16 bits first)."""
    ops = re.findall(r"wgmma\.mma_async\S*", ptx)
    return bool(ops) and all(".e4m3.e4m3" in op for op in ops)


def kernel_report(name: str, fn, pointer_types: dict, constexprs: dict, num_warps: int,
                  num_stages: int = 2, arch: int = 90) -> KernelReport:
    """Compile any Triton kernel for ``arch`` on this machine: pointer arguments typed by
    ``pointer_types`` (other upper-case names are int32 pointers), names with 'scale', 'softcap'
    or 'rope' fp32, the rest int32."""
    sig = {}
    for n in fn.arg_names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in pointer_types:
            sig[n] = pointer_types[n]
        elif n.isupper():
            sig[n] = "*i32"
        elif any(w in n for w in ("scale", "softcap", "rope")):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                                 attrs=_launch_attrs(fn, sig)),
                       target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = k.asm["ptx"]
    regs, st, ld = _ptxas_usage(ptx, arch)
    return KernelReport(name, regs, st, ld, wgmma="wgmma.mma_async" in ptx or "mma.sync" in ptx,
                        tma="cp.async.bulk.tensor" in ptx, warp_specialized="setmaxnreg" in ptx)


def _flags(d: int, block_m: int, block_n: int, causal: bool) -> dict:
    return dict(HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_D=d, BLOCK_DV=d, BLOCK_M=block_m, BLOCK_N=block_n,
                IS_VARLEN=False, HAS_LEFT=False, HAS_RIGHT=causal, HAS_SOFTCAP=False, HAS_ALIBI=False,
                HAS_DROPOUT=False)


def default_reports(arch: int = 90, head_dims=(64, 128, 256)) -> list[KernelReport]:
    """The kernels the H200 configs launch (configs.py), plus the TMA+WS forward."""
    from ioattn.dense.configs import bwd_config_for, fwd_config_for

    out = []
    for d in head_dims:
        # the forward in bf16, and in fp8 (q, k, v e4m3, block descales read per key block, V
        # with its keys innermost as ioattn.fp8.quantize_qkv returns it), each its own config
        for masked, fp8 in ((False, False), (False, True), (True, False), (True, True)):
            fc = fwd_config_for((arch // 10, arch % 10), d, d, masked, 16384, fp8=fp8)
            tma = fc.tma and d <= 128
            ce = dict(_flags(d, fc.block_m, fc.block_n, masked), USE_TMA=tma,
                      WARP_SPEC=tma and fc.warp_specialize and fc.num_warps == 8)
            if fp8:
                ce.update(FP8=True, KD_BLOCKED=True, VD_BLOCKED=True,
                          FP8_BLOCK=triton_fwd.FP8_BLOCK, V_T=True)
            tag = (f"{'fp8 ' if fp8 else ''}fwd d{d} {'causal' if masked else 'full'} "
                   f"{fc.block_m}x{fc.block_n} w{fc.num_warps}"
                   + (" tma+ws" if ce["WARP_SPEC"] else " tma" if tma else ""))
            out.append(compile_report(tag, triton_fwd._attn_fwd_kernel, ce, fc.num_warps,
                                      fc.num_stages, arch, dtype="fp8e4nv" if fp8 else "bf16"))
        bc = bwd_config_for((arch // 10, arch % 10), d, d, False)
        ce = dict(_flags(d, bc.block_m, bc.block_n, False), KEYS_AS_B=bc.keys_as_b, USE_TMA=bc.tma)
        out.append(compile_report(f"bwd dkdv d{d} {bc.block_m}x{bc.block_n} w{bc.num_warps}",
                                  triton_bwd._bwd_dkdv_kernel, ce, bc.num_warps, bc.num_stages, arch))
        ce = dict(_flags(d, bc.block_m_dq, bc.block_n_dq, False), USE_TMA=bc.tma)
        out.append(compile_report(f"bwd dq d{d} {bc.block_m_dq}x{bc.block_n_dq} w{bc.num_warps}",
                                  triton_bwd._bwd_dq_kernel, ce, bc.num_warps, bc.num_stages, arch))
    return out


_TMA_LAYOUT = ("NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth={bits}, rank=2, "
               "transposed=False, fp4_padded=False, cga_layout=[])")


def _gluon_signature(fn, dtype: str, desc_rows: dict, d: int, heads_view: bool = False) -> dict:
    """heads_view: the operand descriptors as [rows, 1, d] boxes over [rows, heads, d_real]
    views (``rows_descriptor(pad_to=d)``). A descriptor's desc_rows entry may be (rows, cols,
    heads view) of its own instead of its rows."""
    sig = {}
    for name in fn.arg_names:
        if name == "dqa_desc":  # the fp32 dQ accumulator (fused backward: its column block)
            from ioattn.dense.sm90_bwd import dq_cols

            cols = dq_cols(d)
            sig[name] = f"tensordesc<fp32[{desc_rows[name]}, {cols}],{_TMA_LAYOUT.format(bits=32)}>"
        elif name.endswith("_desc"):
            rows, cols, hv = desc_rows[name], d, heads_view
            if isinstance(rows, tuple):  # (rows, cols, heads view) of this descriptor's own
                rows, cols, hv = rows
            lay_ = _TMA_LAYOUT.format(bits=16).replace("rank=2", "rank=3" if hv else "rank=2")
            box = f"{rows}, 1, {cols}" if hv else f"{rows}, {cols}"
            sig[name] = f"tensordesc<{dtype}[{box}],{lay_}>"
        elif name in ("O", "DQ", "DK", "DV"):
            sig[name] = f"*{dtype}"
        elif name in ("LSE", "DELTA"):
            sig[name] = "*fp32"
        elif name in ("CU_Q", "CU_K", "BT", "COUNTER"):  # COUNTER: the dynamic tile counter
            sig[name] = "*i32"
        elif name in ("qk_scale_log2", "sm_scale"):
            sig[name] = "fp32"
        elif name == "softcap_scale":  # None (no softcap, a constexpr) unless a job says "fp32"
            sig[name] = "constexpr"
        elif name == "head_group":  # 1 (a constexpr, as the launcher specializes it) unless a
            sig[name] = "constexpr"  # job says "i32": the grouped heaviest-first order
        elif name.isupper() or name.endswith("_"):
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    return sig


def gluon_reports(arch: int = 90, head_dims=(64, 128, 256), dtype: str = "bf16",
                  jobs: int = 1) -> list[KernelReport]:
    """The sm90 Gluon kernels (sm90_fwd.py, sm90_bwd.py) compiled as their launchers configure
    them; jobs > 1: that many processes compile them (the ~100 forms take ~7 min on one core;
    each compile is one core's ptxas), the reports in ``gluon_jobs``' order."""
    todo = gluon_jobs(head_dims, dtype)
    if jobs <= 1:
        return [gluon_report(*job, arch) for job in todo]
    import concurrent.futures
    import multiprocessing

    # spawned workers rebuild the job list (kernels are not picklable) from the same
    # environment, so job i is the same form there
    with concurrent.futures.ProcessPoolExecutor(
            jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_gluon_job_report, [(i, job[0], tuple(head_dims), dtype, arch)
                                                 for i, job in enumerate(todo)]))


def _gluon_job_report(args: tuple) -> KernelReport:
    """(``gluon_reports``' workers) the report of ``gluon_jobs(head_dims, dtype)[i]``, checked to
    be the job the parent named (a worker that sees other settings would label another form)."""
    i, name, head_dims, dtype, arch = args
    job = gluon_jobs(head_dims, dtype)[i]
    if job[0] != name:
        raise RuntimeError(f"compile job {i}: the worker built {job[0]!r}, the parent {name!r} "
                           "(module settings changed in the parent after import?)")
    return gluon_report(*job, arch)


def gluon_sass(name: str, head_dim: int, arch: int = 90, dtype: str = "bf16") -> str:
    """The SASS of one kernel of ``gluon_reports`` (by its report name), as cuobjdump prints it."""
    jobs = [job for job in gluon_jobs((head_dim,), dtype) if job[0] == name]
    if len(jobs) != 1:
        raise ValueError(f"{name!r}: {len(jobs)} kernels of that name at d={head_dim}")
    _, fn, sig, ce = jobs[0]
    return _sass_text(_gluon_compile(fn, sig, ce, arch, {}).asm["cubin"])


def gluon_jobs(head_dims=(64, 128, 256), dtype: str = "bf16") -> list[tuple]:
    """(name, kernel, signature, constexprs) of each sm90 Gluon kernel form ``gluon_reports``
    compiles."""
    from ioattn.dense import sm90_bwd, sm90_fwd

    regs = dict(CONSUMER_REGS_=sm90_fwd.CONSUMER_REGS, PRODUCER_REGS_=sm90_fwd.PRODUCER_REGS)
    jobs = []
    for d in head_dims:
        bn = sm90_fwd._block_n(d)
        # varlen adds the zeroing of tile rows past the last packed sequence
        for tag, causal, varlen in (("full", False, False), ("causal", True, False),
                                    ("varlen causal", True, True)):
            flags = dict(IS_VARLEN=varlen, HAS_LEFT=False, HAS_RIGHT=causal, **regs)
            # the forward as launched on long problems: three consumer warpgroups (192-row
            # tiles) at d=64, on 128-key tiles when causal and batched
            form = sm90_fwd.launch_form(d, varlen, "causal" if causal else "none", 1 << 14,
                                        q_regs=False)
            tile_n = form["BLOCK_N"]
            jobs.append((f"sm90 fwd d{d} {tag} {64 * form['WGS']}x{tile_n} ws",
                         sm90_fwd._attn_fwd_sm90,
                         dict(q_desc=64, o_desc=64, k_desc=tile_n, v_desc=tile_n), d,
                         dict(flags, PAGED=False, PAGE=1, **form)))
            qform = sm90_fwd.q_regs_form(form, d, "causal" if causal else "none")
            if not varlen and qform.get("Q_REGS"):  # (IOATTN_SM90_FWD_Q_REGS, opt-in)
                jobs.append((f"sm90 fwd d{d} {tag} q-regs={qform['Q_REGS']} "
                             f"{64 * form['WGS']}x{tile_n} ws", sm90_fwd._attn_fwd_sm90,
                             dict(q_desc=64, o_desc=64, k_desc=tile_n, v_desc=tile_n), d,
                             dict(flags, PAGED=False, PAGE=1, **qform)))
            bwd_desc = dict(q_desc=64, do_desc=64, k_desc=64, v_desc=64, dqa_desc=64, dk_desc=64,
                            dv_desc=64)
            dq_bn = sm90_bwd._dq_block_n(d)
            # the other row-stats form (LSE / delta in shared memory or held in registers)
            other_rs = " global-loads" if sm90_bwd.ROW_STATS else " rowstats"
            if d == 256:  # column-split dK/dV (in both row-stats forms), dQ on 32-key tiles
                jobs += [(f"sm90 bwd dkdv-cols{suffix} d{d} {tag} 64 keys ws",
                          sm90_bwd._bwd_dkdv_cols_sm90, bwd_desc, d,
                          dict(flags, STAGES=sm90_bwd.DKDV_STAGES, ROW_STATS=rs))
                         for suffix, rs in (("", sm90_bwd.ROW_STATS),
                                            (other_rs, not sm90_bwd.ROW_STATS))]
            else:
                # the two-kernel and fused forms on 64-row steps (the fused one in this mask's
                # dQ order; at d = 64 the ROWS=64 form), and (full) the fused one in each other
                # dQ order
                launched = sm90_bwd.dq_order(d, causal)
                orders = [launched] + ([o for o in sm90_bwd.DQ_ORDERS if o != launched
                                        and (o != "alt" or d == 64)] if tag == "full" else [])
                seg = sm90_bwd.segments(d, causal)
                opt = dict(SEGMENTS=seg, ROW_STATS=sm90_bwd.ROW_STATS)
                two_kernel = dict(FUSED_DQ=False, **opt)
                fused = {o: dict(FUSED_DQ=True, DQ_FIRST=o == "first", DQ_LAG=o == "lag",
                                 DQ_ALT=o == "alt", **opt) for o in orders}
                forms = [("", two_kernel)] + [(f"+dq {o}", fused[o]) for o in orders]
                if tag == "causal":  # the steps in masked / unmasked loops (or not)
                    forms.append((f"+dq {launched} segments={not seg}",
                                  dict(fused[launched], SEGMENTS=not seg)))
                # the other row-stats form, two-kernel and fused as launched
                forms += [(f"{suffix}{other_rs}", dict(form, ROW_STATS=not sm90_bwd.ROW_STATS))
                          for suffix, form in (("", two_kernel), (f"+dq {launched}",
                                                                  fused[launched]))]
                if tag == "causal":  # softcap: tanh on Sᵀ, P (1 - tanh²) into dS
                    forms.append((f"+dq {launched} softcap", dict(fused[launched],
                                                                  softcap_scale="fp32")))
                jobs += [(f"sm90 bwd dkdv{suffix} d{d} {tag} 128 keys ws", sm90_bwd._bwd_dkdv_sm90,
                          bwd_desc, d, dict(flags, STAGES=sm90_bwd.DKDV_STAGES, TMA_STORE=True,
                                            **form))
                         for suffix, form in forms]
                if d == 64:  # the fused form as launched at d = 64 (IOATTN_SM90_BWD_ROWS):
                    # 128-row steps, Q / dO by 128-row boxes, dQ after dK's update (full: also
                    # first)
                    jobs += [(f"sm90 bwd dkdv+dq {o} rows=128 d{d} {tag} 128 keys ws",
                              sm90_bwd._bwd_dkdv_sm90, dict(bwd_desc, q_desc=128, do_desc=128), d,
                              dict(flags, STAGES=sm90_bwd.DKDV_STAGES, TMA_STORE=True,
                                   **dict(fused[launched], DQ_FIRST=o == "first", DQ_LAG=False,
                                          DQ_ALT=False)))
                             for o in (("after", "first") if tag == "full" else ("after",))]
            dq_forms = [("", {})] + ([(" softcap", dict(softcap_scale="fp32"))]
                                     if (d, tag) == (128, "causal") else [])
            jobs += [(f"sm90 bwd dq{suffix} d{d} {tag} 128x{dq_bn} ws", sm90_bwd._bwd_dq_sm90,
                      dict(q_desc=64, do_desc=64, k_desc=dq_bn, v_desc=dq_bn), d,
                      dict(flags, STAGES=sm90_bwd.DQ_STAGES, **extra))
                     for suffix, extra in dq_forms]
        if d == 64:  # (opt-in, IOATTN_SM90_WG3_PERSISTENT) the persistent form on 3 warpgroups,
            # and (opt-in, IOATTN_SM90_PINGPONG=1) with their turns round robin; and (opt-in,
            # IOATTN_SM90_WG3_BLOCK_N=128) FA3's 192x128 tile non-causal, with the turns
            tile_n, stages, cregs = sm90_fwd._tile(d, 3)
            wg3 = [("causal", True, tile_n, stages, False), ("causal", True, tile_n, stages, True),
                   ("full", False, 128, 3, True)]
            jobs += [(f"sm90 fwd d{d} {tag_} persistent 192x{bn_}{' pingpong' if pp else ''} ws",
                      sm90_fwd._attn_fwd_sm90,
                      dict(q_desc=64, o_desc=64, k_desc=bn_, v_desc=bn_), d,
                      dict(IS_VARLEN=False, HAS_LEFT=False, HAS_RIGHT=right,
                           PRODUCER_REGS_=sm90_fwd.PRODUCER_REGS, CONSUMER_REGS_=cregs,
                           STAGES=st_, BLOCK_N=bn_, PAGED=False, PAGE=1, PINGPONG=pp,
                           PERSISTENT=True, WGS=3, DYNAMIC=True,
                           EXP_EARLY=sm90_fwd._exp_early(d, bn_ == 128,
                                                         "causal" if right else "none")))
                     for tag_, right, bn_, st_, pp in wg3]
            # the batched causal forward as launched below 4k queries (two warpgroups, 128-key
            # tiles, persistent)
            jobs.append(_batched_causal_job(d, "2k ", 2048))
        if d == 128:  # softcap (its tanh before the softmax), the causal form of long problems
            jobs.append(_batched_causal_job(d, "softcap ", 1 << 14, softcap_scale="fp32"))
            # (IOATTN_SM90_FWD_O_TMA=0) the persistent forward's O stored from registers, not
            # by TMA from the last V stage, without a mask
            jobs += [(name.replace(" 128x", " o-regs 128x"), fn, desc, d_, dict(ce, O_TMA=False))
                     for name, fn, desc, d_, ce in jobs if name == f"sm90 fwd d{d} full 128x128 ws"]
            # (IOATTN_SM90_FWD_O_DEFER=0) O's V stage waited for at the store, not released a
            # block into the next tile
            jobs += [(name.replace(" 128x", " o-nodefer 128x"), fn, desc, d_, dict(ce, O_TMA=1))
                     for name, fn, desc, d_, ce in jobs
                     if name in (f"sm90 fwd d{d} full 128x128 ws",
                                 f"sm90 fwd d{d} causal 128x128 ws")]
        if d in (64, 128):  # (the default up to 8k keys, IOATTN_SM90_FWD_Q_BUFS) the
            # persistent forward with Q in two buffers: d=64 causal below 4k (two warpgroups)
            # and from 4k (three), d=128 (two stages then) with and without a mask
            qb = ([f"sm90 fwd d{d} causal 2k 128x128 ws", f"sm90 fwd d{d} causal 192x128 ws"]
                  if d == 64 else
                  [f"sm90 fwd d{d} full 128x128 ws", f"sm90 fwd d{d} causal 128x128 ws"])
            jobs += [(name.replace(" ws", " qbufs2 ws"), fn, desc, d_,
                      sm90_fwd.two_q_buffers(ce, d)) for name, fn, desc, d_, ce in jobs
                     if name in qb]

        if d in (128, 256):  # (opt-in, IOATTN_SM90_FWD_LPT / _BWD_LPT) the grouped heaviest-
            # first order: the causal forward at 4k (d=128: the dynamic scheduler's ids; d=256:
            # one CTA per tile, the grid's), the causal dK/dV kernel as launched, the dQ kernel
            if d == 128:
                jobs.append(_batched_causal_job(d, "lpt ", 1 << 12, head_group="i32"))
                # (the default, IOATTN_SM90_FWD_STREAM_COUNTERS) the last CTA zeroes the counter
                jobs.append(_batched_causal_job(d, "lpt counter-reset ", 1 << 12,
                                                head_group="i32", COUNTER_RESET=True))
            launched = [f"sm90 bwd dkdv-cols d{d} causal 64 keys ws" if d == 256 else
                        f"sm90 bwd dkdv+dq {sm90_bwd.dq_order(d, True)} d{d} causal 128 keys ws",
                        f"sm90 bwd dq d{d} causal 128x{sm90_bwd._dq_block_n(d)} ws"]
            if d == 256:
                launched.append(f"sm90 fwd d{d} causal 128x{sm90_fwd._block_n(d)} ws")
            jobs += [(name.replace(" ws", " lpt ws"), fn, desc, d_, dict(ce, head_group="i32"))
                     for name, fn, desc, d_, ce in jobs if name in launched]
        # head dims read in place through [rows, heads, d] views, boxes zero-filled past d
        # (IOATTN_SM90_PAD=tma): 96 as 128 batched (persistent), (192, 128) as 256 varlen
        # causal (O's partial tiles stored from registers, columns past 128 masked)
        if d in (128, 256):
            real, varlen = (96, False) if d == 128 else (128, True)
            mask = "causal" if varlen else "none"
            form = sm90_fwd.launch_form(d, varlen, mask, 1 << 14, q_regs=False)
            d_real = 96 if d == 128 else 192

            def fwd_view_job(tag, varlen_, mask_, form_, v_box, o_box, **ce):
                return (f"sm90 fwd d{d} {mask_} heads-view {tag}"
                        f"{64 * form_['WGS']}x{form_['BLOCK_N']} ws", sm90_fwd._attn_fwd_sm90,
                        dict(q_desc=64, o_desc=o_box, k_desc=form_["BLOCK_N"], v_desc=v_box), d,
                        dict(IS_VARLEN=varlen_, HAS_LEFT=False, HAS_RIGHT=varlen_,
                             PRODUCER_REGS_=sm90_fwd.PRODUCER_REGS, PAGED=False, PAGE=1,
                             **dict(form_, O_TMA=False), heads_view=True, **ce))
            jobs.append(fwd_view_job(f"O_COLS={real} ", varlen, mask, form, form["BLOCK_N"], 64,
                                     O_COLS=real))
            # IOATTN_SM90_PAD_NARROW: QKᵀ over d's own columns (two wgmma groups), V and O in
            # tiles of d_v's own width ((192, 128): 2D 128-column boxes, not heads views)
            narrow_v = (form["BLOCK_N"], d, True) if d == 128 else (form["BLOCK_N"], 128, False)
            narrow_o = (64, d, True) if d == 128 else (64, 128, False)
            jobs.append(fwd_view_job(f"narrow QK_COLS={d_real} ", varlen, mask, form, narrow_v,
                                     narrow_o, O_COLS=96 if d == 128 else 0, QK_COLS=d_real))
            if d == 256:  # (192, 192) batched: V / O still 256 wide, QKᵀ over 192
                form2 = sm90_fwd.launch_form(d, False, "none", 1 << 14, q_regs=False)
                jobs.append(fwd_view_job("narrow QK_COLS=192 O_COLS=192 ", False, "none", form2,
                                         form2["BLOCK_N"], 64, O_COLS=192, QK_COLS=192))
            # and the backward over the same views: dK / dV (96 / 96, or 192 / 128) and dQ
            # (d_k) stores masked past the tensors' head dims
            k_cols = 96 if d == 128 else 192
            hv = dict(IS_VARLEN=varlen, HAS_LEFT=False, HAS_RIGHT=varlen, **regs,
                      heads_view=True)
            bwd_desc = dict(q_desc=64, do_desc=64, k_desc=64, v_desc=64, dqa_desc=64, dk_desc=64,
                            dv_desc=64)
            if d == 256:
                jobs.append((f"sm90 bwd dkdv-cols d{d} {mask} heads-view K_COLS={k_cols} "
                             f"V_COLS={real} 64 keys ws", sm90_bwd._bwd_dkdv_cols_sm90, bwd_desc,
                             d, dict(hv, STAGES=sm90_bwd.DKDV_STAGES, ROW_STATS=sm90_bwd.ROW_STATS,
                                     K_COLS=k_cols, V_COLS=real)))
            else:
                order = sm90_bwd.dq_order(d, varlen)
                # (K in one 128-row box over 3D views, as the launcher builds it)
                jobs.append((f"sm90 bwd dkdv+dq {order} d{d} {mask} heads-view K_COLS={k_cols} "
                             f"128 keys ws", sm90_bwd._bwd_dkdv_sm90, dict(bwd_desc, k_desc=128), d,
                             dict(hv, STAGES=sm90_bwd.DKDV_STAGES, FUSED_DQ=True,
                                  DQ_FIRST=order == "first", DQ_LAG=order == "lag",
                                  DQ_ALT=order == "alt", SEGMENTS=sm90_bwd.segments(d, varlen),
                                  ROW_STATS=sm90_bwd.ROW_STATS, K_COLS=k_cols, V_COLS=real)))
            dq_bn = sm90_bwd._dq_block_n(d)
            jobs.append((f"sm90 bwd dq d{d} {mask} heads-view K_COLS={k_cols} 128x{dq_bn} ws",
                         sm90_bwd._bwd_dq_sm90,
                         dict(q_desc=64, do_desc=64, k_desc=dq_bn, v_desc=dq_bn), d,
                         dict(hv, STAGES=sm90_bwd.DQ_STAGES, K_COLS=k_cols)))
            # IOATTN_SM90_PAD_NARROW: S / dP over d's / d_v's own columns (the dQ kernel; at
            # d = 256 the column-split dK/dV kernel too)
            narrow = dict(QK_COLS=k_cols, DP_COLS=real)
            jobs.append((f"sm90 bwd dq d{d} {mask} heads-view narrow QK_COLS={k_cols} "
                         f"DP_COLS={real} 128x{dq_bn} ws", sm90_bwd._bwd_dq_sm90,
                         dict(q_desc=64, do_desc=64, k_desc=dq_bn, v_desc=dq_bn), d,
                         dict(hv, STAGES=sm90_bwd.DQ_STAGES, K_COLS=k_cols, **narrow)))
            if d == 256:
                jobs.append((f"sm90 bwd dkdv-cols d{d} {mask} heads-view narrow "
                             f"QK_COLS={k_cols} DP_COLS={real} 64 keys ws",
                             sm90_bwd._bwd_dkdv_cols_sm90, bwd_desc, d,
                             dict(hv, STAGES=sm90_bwd.DKDV_STAGES, ROW_STATS=sm90_bwd.ROW_STATS,
                                  K_COLS=k_cols, V_COLS=real, **narrow)))
        # the KV-cache forward over pages of 16 (one TMA copy per page); at d=128 also with
        # softcap
        for cap in ((False, True) if d == 128 else (False,)):
            jobs.append((f"sm90 fwd paged16 d{d} causal{' softcap' if cap else ''} 128x{bn} ws",
                         sm90_fwd._attn_fwd_sm90,
                         dict(q_desc=64, o_desc=64, k_desc=16, v_desc=16), d,
                         dict(IS_VARLEN=False, HAS_LEFT=False, HAS_RIGHT=True, **regs,
                              STAGES=sm90_fwd._stages(d), BLOCK_N=bn, PAGED=True, PAGE=16,
                              PINGPONG=sm90_fwd._pingpong(d, 2), PERSISTENT=False, WGS=2,
                              EXP_EARLY=sm90_fwd._exp_early(d, False, "causal"),
                              **({"softcap_scale": "fp32"} if cap else {}))))
    out = []
    for name, fn, desc_rows, d, ce in jobs:
        sig = _gluon_signature(fn, dtype, desc_rows, d, ce.get("heads_view", False))
        ce = {k: v for k, v in ce.items() if k != "heads_view"}
        for name_, kind in (("softcap_scale", "fp32"), ("head_group", "i32")):
            if ce.get(name_) == kind:  # softcap on: a runtime scale; a runtime head group
                sig[name_] = kind
                ce = {k: v for k, v in ce.items() if k != name_}
        if sig.get("kv_group") == "i32":  # 1 in the grid's launches: the launcher's constexpr
            sig["kv_group"] = "constexpr"
            ce = dict(ce, kv_group=1)
        out.append((name, fn, sig, ce))
    return out


def _batched_causal_job(d: int, tag: str, s_q: int, **extra) -> tuple:
    """(``gluon_jobs``) The batched causal forward in the form its launcher takes at s_q
    queries; extra constexprs (or ``softcap_scale="fp32"``) added."""
    from ioattn.dense import sm90_fwd

    form = sm90_fwd.launch_form(d, False, "causal", s_q, q_regs=False)
    return (f"sm90 fwd d{d} causal {tag}{64 * form['WGS']}x{form['BLOCK_N']} ws",
            sm90_fwd._attn_fwd_sm90,
            dict(q_desc=64, o_desc=64, k_desc=form["BLOCK_N"], v_desc=form["BLOCK_N"]), d,
            dict(IS_VARLEN=False, HAS_LEFT=False, HAS_RIGHT=True,
                 PRODUCER_REGS_=sm90_fwd.PRODUCER_REGS, PAGED=False, PAGE=1, **extra, **form))


def _gluon_compile(fn, sig: dict, constexprs: dict, arch: int, options: dict):
    from triton.experimental.gluon._runtime import GluonASTSource

    # every constexpr parameter explicitly, defaults included: Triton 3.6's compile cache keys on
    # the constexpr values without their names, so {A: True} and {B: True} would share a kernel
    constexprs = {**{prm.name: prm.default for prm in fn.params
                     if sig.get(prm.name) == "constexpr" and prm.has_default}, **constexprs}
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=constexprs,
                                         attrs=_launch_attrs(fn, sig, constexprs)),
                          target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4, **options))


def gluon_report(name: str, fn, sig: dict, constexprs: dict, arch: int = 90,
                 **options) -> KernelReport:
    """Compile one Gluon kernel for sm_{arch} (signature and constexprs as ``triton.compile``
    takes them, with the launcher's divisibility hints) and report what it compiled to."""
    k = _gluon_compile(fn, sig, constexprs, arch, options)
    ptx = k.asm["ptx"]
    regs_used, st, ld = _ptxas_usage(ptx, arch)
    sass = _sass_text(k.asm["cubin"])
    return KernelReport(
        name, regs_used, st, ld, wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx,
        warp_specialized="setmaxnreg" in ptx, mbarrier_waits=ptx.count("mbarrier.try_wait"),
        shared_bytes=k.metadata.shared, sass=_sass_counts(sass), loops=loop_spills(sass),
        tma_reduce="cp.reduce.async.bulk.tensor" in ptx,
        grid_dependency="griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx,
        fp8_wgmma=_all_fp8_wgmma(ptx))


def _desc_sig(dtype: str, rows: int, cols: int, bits: int) -> str:
    """A 2D TMA descriptor's signature entry with the NVMMA layout the host builds for its box
    (``sm90_common.shared_layout``: the swizzle of a box row's bytes, at most 128)."""
    swizzle = min(128, cols * bits // 8)
    lay = _TMA_LAYOUT.format(bits=bits).replace("swizzle_byte_width=128",
                                                f"swizzle_byte_width={swizzle}")
    return f"tensordesc<{dtype}[{rows}, {cols}],{lay}>"


def fp8_fwd_gluon_reports(arch: int = 90, head_dims=(64, 128, 256)) -> list[KernelReport]:
    """The sm90 forward on fp8 (e4m3) q, k, v as ``sm90_fwd._attn_fwd_sm90_fp8`` launches it
    (batched, one CTA per tile, V's descriptor keys innermost, O in bf16), without and with a
    causal mask, with per-head and (IOATTN_SM90_FP8_BLOCK) block descales, varlen causal
    (IOATTN_SM90_FP8_VARLEN) with either, and persistent (IOATTN_SM90_FP8_PERSISTENT; full
    per-head, causal block descales, and causal per-head in grouped order with GQA), and
    (IOATTN_SM90_FWD_Q_REGS) causal per-head with all of Q in registers, and persistent causal
    block descales with it, at each head dim."""
    from ioattn.dense import sm90_fwd

    fn = sm90_fwd._attn_fwd_sm90
    out = []
    for d in head_dims:
        form = sm90_fwd._fp8_form(d)
        bn = form["BLOCK_N"]
        # the 16-bit forward's signature, its descriptors, O and the descales as fp8 launches
        # them (V's box keys innermost; kv_group 1 a constexpr, as ``gluon_jobs``)
        sig = dict(_gluon_signature(fn, "fp8e4nv", dict(q_desc=64, k_desc=bn, v_desc=bn,
                                                        o_desc=64), d),
                   q_desc=_desc_sig("fp8e4nv", 64, d, 8), k_desc=_desc_sig("fp8e4nv", bn, d, 8),
                   v_desc=_desc_sig("fp8e4nv", d, bn, 8), o_desc=_desc_sig("bf16", 64, d, 16),
                   O="*bf16", QD="*fp32", KD="*fp32", VD="*fp32", kv_group="constexpr",
                   COUNTER="constexpr")
        # (tag, causal, block descales, varlen, persistent, all of Q in registers); "grouped":
        # persistent in grouped heaviest-first order (LPT's) with the head group and KV group
        # runtime integers; "q-regs": IOATTN_SM90_FWD_Q_REGS (persistent: Q's buffer back once
        # loaded)
        for tag, causal, blocked, varlen, pers, q_regs in (
                ("", False, False, False, False, False), ("", True, False, False, False, False),
                ("", False, True, False, False, False), ("", True, True, False, False, False),
                ("", True, False, True, False, False), ("", True, True, True, False, False),
                ("", False, False, False, True, False), ("", True, True, False, True, False),
                ("grouped ", True, False, False, True, False),
                ("q-regs ", True, False, False, False, True),
                ("q-regs ", True, True, False, True, True)):
            pform = sm90_fwd._fp8_form(d, varlen, pers, q_regs=q_regs)
            ce = dict(pform, IS_VARLEN=varlen, HAS_LEFT=False, HAS_RIGHT=causal,
                      PRODUCER_REGS_=sm90_fwd.PRODUCER_REGS, PAGED=False, PAGE=1,
                      softcap_scale=None, O_COLS=0, head_group=1, QK_COLS=0,
                      COUNTER_RESET=pers, kv_group=1, DS_BLOCKED=blocked,
                      **({} if pers else dict(COUNTER=None)))
            psig = dict(sig, COUNTER="*i32" if pers else "constexpr")
            if tag == "grouped ":
                del ce["head_group"], ce["kv_group"]
                psig.update(head_group="i32", kv_group="i32")
            out.append(gluon_report(f"sm90 fp8 fwd d{d} {'varlen ' if varlen else ''}{tag}"
                                    f"{'persistent ' if pers else ''}"
                                    f"{'causal' if causal else 'full'}"
                                    f"{' block-descales' if blocked else ''} 128x{bn} ws", fn,
                                    psig, ce, arch))
    return out


def decode_gluon_report(d: int = 128, page: int = 16, dtype: str = "bf16",
                        arch: int = 90, merge: bool = False, group: int = 4,
                        kv_dtype: str | None = None, balanced: bool = False,
                        softcap: bool = False, pdl: bool | None = None,
                        heads_first: bool | None = None,
                        prefetch: bool | None = None, claim: bool | str = False) -> KernelReport:
    """The sm90 paged decode kernel (``ioattn.decode.sm90_decode``) as its launcher specializes it
    (kv_dtype "fp8e4nv" / "fp8e5": an fp8 cache, converted in shared memory; balanced: a
    balanced plan's columns, each CTA looping over its items; softcap: its tanh on the scores;
    pdl / heads_first / prefetch: those switches, default as the environment sets them; claim:
    the CTAs claiming their units, as a graph-mode launch on the bound's grid; "spread": and
    only an even subset of SMs claiming at once, IOATTN_SM90_DECODE_CLAIM_SPREAD)."""
    from ioattn.decode import sm90_decode as sd

    fn = sd._decode_sm90
    box = min(page, sd.BLOCK_N)
    kv = kv_dtype or dtype
    fp8 = kv != dtype
    desc = _desc_sig(kv, box, d, 8 if fp8 else 16)
    ptrs = dict(Q=f"*{dtype}", O=f"*{dtype}", LSE="*fp32", O_PART="*fp32", LSE_PART="*fp32",
                SEQ="*i32", INDICES="*i32", WORK="*i32", N_WORK="*i32", COUNTS="*i32",
                SLOT_START="*i32", K_RAW=f"*{kv}", V_RAW=f"*{kv}",
                **(dict(COLS="*i32") if balanced else {}),
                **(dict(CLAIMS="*i32") if claim else {}))
    sig = {n: desc if n.endswith("_desc") else ptrs.get(n, "constexpr" if n.isupper() or
                                                        n.endswith("_") else "i32")
           for n in fn.arg_names}
    sig["qk_scale_log2"] = "fp32"
    sig["softcap_scale"] = "fp32" if softcap else "constexpr"
    pdl = sd.PDL if pdl is None else pdl
    heads_first = sd.HEADS_FIRST if heads_first is None else heads_first
    prefetch = sd.PREFETCH if prefetch is None else prefetch
    ce = dict(LSE_BASE2=True, **sd.launch_constexprs(d, page, group, fp8, merge, balanced, pdl,
                                                     heads_first, prefetch, bool(claim)))
    ce["CLAIM_SPREAD_"] = ce["CLAIM_"] and claim == "spread"
    if not claim:
        ce["CLAIMS"] = None
    if not softcap:
        ce["softcap_scale"] = None
    if not balanced:
        ce["COLS"] = None
    if not ce["PREFETCH_"]:  # (the views' rows: an argument only with the prefetches)
        sig["view_rows"] = "constexpr"
        ce["view_rows"] = None
    return gluon_report(f"sm90 paged decode d{d} page{page}{' merge' if merge else ''}"
                        f"{' ' + kv if fp8 else ''}{' balanced' if balanced else ''}"
                        f"{' softcap' if softcap else ''}{' pdl' if pdl else ''}"
                        f"{' heads-first' if heads_first else ''}"
                        f"{' prefetch' if ce['PREFETCH_'] else ''}"
                        f"{' claim' if ce['CLAIM_'] else ''}"
                        f"{' spread' if ce['CLAIM_SPREAD_'] else ''}"
                        f"{' early' if ce['EARLY_'] else ''} ws", fn, sig, ce, arch,
                        maxnreg=sd.launch_maxnreg(d), launch_pdl=pdl)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--gluon", action="store_true", help="the sm90 Gluon kernels instead")
    ap.add_argument("--gluon-fp8", action="store_true",
                    help="the sm90 Gluon forward on fp8 q, k, v instead")
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes compiling the Gluon kernels (--gluon; default 1)")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    if a.gluon_fp8:
        reports = fp8_fwd_gluon_reports(a.arch, tuple(int(x) for x in a.dims.split(",")))
    elif a.gluon:
        reports = gluon_reports(a.arch, jobs=a.jobs)
    else:
        reports = default_reports(a.arch, tuple(int(x) for x in a.dims.split(",")))
    if a.json:
        print(json.dumps([r.__dict__ for r in reports], indent=1))
    else:
        for r in reports:
            print(r.row())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

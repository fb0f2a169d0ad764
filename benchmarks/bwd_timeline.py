"""Where a fused sm90 dK/dV CTA's time goes: %globaltimer stamps at fixed points of each CTA
(producer start and SM id, each consumer warpgroup's start / K-V arrival / first step done /
loop done / dK-dV stores issued, the dQ writer's last reduction read), from a copy of
``ioattn.dense.sm90_bwd`` with the stamps added (the library's kernels are not changed), on one
FA-grid backward call. Prints per-CTA phase medians and the gap between consecutive CTAs on an
SM; ``--json`` writes the summary.

    python benchmarks/bwd_timeline.py --d 128 --seqlen 2048 [--causal] [--json out.json]
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import linecache
import os
import statistics

import torch
import triton

import ioattn
from ioattn.dense import sm90_bwd

SLOTS = 16  # u64 stamps per CTA: 0-4 consumer 0, 5-9 consumer 1, 10 SM id, 11 producer start,
# 12 writer end
NAMES = ("start", "kv", "first_step", "loop_end", "stored")


def _asm(base: int, slot: int, per_wg: bool, what: str = "%globaltimer") -> str:
    """PTX storing ``what`` (u64) into stamp ``slot`` of this CTA (``slot + 5 * warpgroup``
    for per_wg), from the first thread of the warpgroup (per_wg) or of the warp."""
    mask = 127 if per_wg else 31
    load = ("mov.u64 %t, %globaltimer;" if what == "%globaltimer"
            else "mov.u32 %w, %smid; cvt.u64.u32 %t, %w;")
    return ("{ .reg .pred %pp; .reg .u32 %i, %c, %y, %n, %w; .reg .u64 %t, %a, %o; "
            "mov.u32 %i, %tid.x; and.b32 %c, %i, " + str(mask) + "; setp.eq.u32 %pp, %c, 0; "
            "shr.u32 %w, %i, 7; min.u32 %w, %w, 1; "
            "mov.u32 %c, %ctaid.x; mov.u32 %y, %ctaid.y; mov.u32 %n, %nctaid.x; "
            "mad.lo.u32 %c, %y, %n, %c; mul.lo.u32 %c, %c, " + str(SLOTS) + "; "
            "add.u32 %c, %c, " + str(slot) + "; "
            + ("mad.lo.u32 %c, %w, 5, %c; " if per_wg else "")
            + "mul.wide.u32 %o, %c, 8; mov.u64 %a, " + str(base) + "; add.u64 %a, %a, %o; "
            + load + " @%pp st.global.u64 [%a], %t; mov.u32 $0, 0; }")


def _stamp_fns(base: int) -> str:
    fns = []
    for name, slot, per_wg, what in [*((f"_tl_c{i}", i, True, "%globaltimer") for i in range(5)),
                                     ("_tl_smid", 10, False, "%smid"),
                                     ("_tl_prod", 11, False, "%globaltimer"),
                                     ("_tl_writer", 12, False, "%globaltimer")]:
        fns.append(f"@gluon.jit\ndef {name}():\n    gl.inline_asm_elementwise("
                   f"{_asm(base, slot, per_wg, what)!r}, '=r', [], dtype=gl.int32, "
                   "is_pure=False, pack=1)\n")
    return "\n\n".join(fns)


def _patch(src: str, old: str, new: str, required: bool = True) -> str:
    n = src.count(old)
    if n != 1 and (required or n > 1):
        raise RuntimeError(f"stamp anchor found {n} times: {old[:80]!r}")
    return src.replace(old, new)


def patched_source(base: int) -> str:
    src = inspect.getsource(sm90_bwd)
    head, sep, rest = src.partition("\n@gluon.jit\n")
    src = head + "\n" + _stamp_fns(base) + "\n" + sep + rest
    src = _patch(src, "    dv = gl.zeros([HALF, HEAD_D], gl.float32, layout=a_layout)\n"
                 "    if n_steps > 0:\n        mbarrier.wait(kv_bar, 0)\n",
                 "    dv = gl.zeros([HALF, HEAD_D], gl.float32, layout=a_layout)\n    _tl_c0()\n"
                 "    if n_steps > 0:\n        mbarrier.wait(kv_bar, 0)\n        _tl_c1()\n")
    src = _patch(src, "                False, 2, ROW_STATS)\n            for t in range(1, n_steps):\n",
                 "                False, 2, ROW_STATS)\n            _tl_c2()\n"
                 "            for t in range(1, n_steps):\n")
    src = _patch(src, "    d_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, a_layout))\n"
                 "    keys = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, a_layout))\n",
                 "    _tl_c3()\n    d_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, a_layout))\n"
                 "    keys = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, a_layout))\n")
    src = _patch(src, "\n\n\n@gluon.jit\ndef _dq_writer(",
                 "\n    _tl_c4()\n\n\n@gluon.jit\ndef _dq_writer(")
    prod = "    ld_layout: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])  # 64 rows over one warp\n"
    src = _patch(src, prod, prod + "    _tl_smid()\n    _tl_prod()\n")
    src = _patch(src, "            mbarrier.arrive(dq_empty.index(1), count=1)\n\n\n",
                 "            mbarrier.arrive(dq_empty.index(1), count=1)\n    _tl_writer()\n\n\n")
    return src


def install(base: int) -> None:
    """The stamped kernels in place of ``sm90_bwd``'s (its launcher, looked up by the op layer at
    each call, then launches them). The source is registered with linecache: the JIT reads each
    function's source back through inspect."""
    src = patched_source(base)
    name = sm90_bwd.__file__ + ":timeline"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    exec(compile(src, name, "exec"), sm90_bwd.__dict__)


def summarize(stamps: torch.Tensor, n_steps: int) -> dict:
    rows = stamps.tolist()
    ctas = []
    for r in rows:
        if r[11] == 0:
            continue
        c = [r[0:5], r[5:10]]
        end = max([c[0][4], c[1][4], r[12]])
        ctas.append(dict(sm=r[10], start=min(r[11], c[0][0], c[1][0]), end=end, c=c,
                         writer=r[12]))
    t0 = min(c["start"] for c in ctas)

    def med(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs) / 1e3, 3) if xs else None

    out = {"ctas": len(ctas), "steps_per_cta": n_steps,
           "kernel_us": round((max(c["end"] for c in ctas) - t0) / 1e3, 1)}
    for wg in (0, 1):
        s = [c["c"][wg] for c in ctas]
        out[f"wg{wg}_us"] = {
            "start->kv": med([x[1] - x[0] for x in s]),
            "kv->first_step": med([x[2] - x[1] if x[2] else None for x in s]),
            "loop": med([x[3] - (x[2] or x[1]) for x in s]),
            "epilogue": med([x[4] - x[3] for x in s])}
    out["producer_start->wg0_start_us"] = med([c["c"][0][0] - c["start"] for c in ctas])
    out["writer_after_stores_us"] = med([c["writer"] - max(c["c"][0][4], c["c"][1][4])
                                         for c in ctas])
    out["cta_us"] = med([c["end"] - c["start"] for c in ctas])
    by_sm: dict[int, list] = {}
    for c in ctas:
        by_sm.setdefault(c["sm"], []).append(c)
    gaps, waves = [], []
    for cs in by_sm.values():
        cs.sort(key=lambda c: c["start"])
        gaps += [b["start"] - a["end"] for a, b in zip(cs, cs[1:])]
        waves.append(len(cs))
    out["gap_between_ctas_us"] = {"median": med(gaps), "max": round(max(gaps) / 1e3, 3)}
    out["ctas_per_sm"] = {"min": min(waves), "max": max(waves), "sms": len(by_sm)}
    # the first wave's start spread and the whole kernel against CTAs * steady step time
    firsts = sorted(min(c["start"] for c in cs) for cs in by_sm.values())
    out["first_wave_start_spread_us"] = round((firsts[-1] - firsts[0]) / 1e3, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    b, h = max(1, 16384 // a.seqlen), 2048 // a.d
    n_ctas = -(-a.seqlen // 128) * b * h
    stamps = torch.zeros(n_ctas, SLOTS, dtype=torch.int64, device="cuda")
    install(stamps.data_ptr())
    q, k, v = (torch.randn(b, a.seqlen, h, a.d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    results = {}
    for i in range(4):
        stamps.zero_()
        torch.cuda.synchronize()
        out = ioattn.flash_attn_func(q, k, v, causal=a.causal, backend="sm90")
        out.backward(dout)
        torch.cuda.synchronize()
        if i >= 2:
            # (steps a CTA: every 64-row query tile without a mask; varies under one)
            results[f"call{i}"] = summarize(stamps.cpu(), -1 if a.causal else a.seqlen // 64)
    summary = {"d": a.d, "seqlen": a.seqlen, "batch": b, "heads": h, "causal": a.causal,
               "dq_order": sm90_bwd.dq_order(a.d, a.causal), **results,
               "tma_store": sm90_bwd.TMA_STORE, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__,
               "date": datetime.date.today().isoformat(),
               "commit": os.environ.get("IOATTN_GIT_COMMIT", "unknown")}
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()

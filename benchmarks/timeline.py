"""Where an sm90 kernel's time goes, CTA by CTA (or tile by tile): %globaltimer stamps at fixed
points, from a copy of the kernel's module with the stamps added (inline PTX storing into a
buffer whose address is baked into the copy; the library's kernels are not changed), on one
FA-grid call. Prints phase medians and the gaps between consecutive CTAs / tiles on an SM;
``--json`` writes the summary.

- ``--kernel bwd``: the fused dK/dV kernel (``sm90_bwd._bwd_dkdv_sm90``), per CTA: producer
  start and SM id; each consumer warpgroup's start, K / V arrival, first step done (lag order),
  loop done, dK / dV stored; the dQ writer's last reduction read.
- ``--kernel fwd``: the persistent forward (``sm90_fwd``, d = 64 / 128 batched), per tile: each
  consumer warpgroup's tile start, Q's arrival, first key block done, last P·V retired, O
  stored; the SM id. ``q_wait`` (start -> Q) is the tile boundary's wait for the next tile's Q,
  ``first`` its first block (QKᵀ and softmax with no P·V under them).

    python benchmarks/timeline.py --kernel bwd --d 128 --seqlen 2048 [--causal] [--json out.json]
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
from ioattn.dense import sm90_bwd, sm90_fwd

BWD_SLOTS = 16  # u64 stamps a CTA: 0-4 consumer 0, 5-9 consumer 1, 10 SM id, 11 producer
# start, 12 writer end
FWD_SLOTS = 16  # u64 stamps a tile: 0-4 consumer 0 (start, P·V done, stored, Q arrived, first
# block done), 5-9 consumer 1, 10 SM id
FWD_WG = 5  # stamps a consumer warpgroup


def _asm(base: int, slots: int, slot: int, wg_stride: int, per_tile: bool,
         smid: bool = False) -> str:
    """PTX storing the time (or the SM id) into stamp ``slot + wg_stride * warpgroup`` of this
    CTA's (per_tile: of tile $1's) ``slots`` stamps, from the warpgroup's first thread
    (wg_stride > 0) or the warp's."""
    mask = 127 if wg_stride else 31
    load = ("mov.u32 %w, %smid; cvt.u64.u32 %t, %w;" if smid
            else "mov.u64 %t, %globaltimer;")
    index = ("mov.u32 %c, $1; " if per_tile else
             "mov.u32 %c, %ctaid.x; mov.u32 %y, %ctaid.y; mov.u32 %n, %nctaid.x; "
             "mad.lo.u32 %c, %y, %n, %c; ")
    return ("{ .reg .pred %pp; .reg .u32 %i, %c, %y, %n, %w, %m; .reg .u64 %t, %a, %o; "
            f"mov.u32 %i, %tid.x; and.b32 %m, %i, {mask}; setp.eq.u32 %pp, %m, 0; "
            "shr.u32 %w, %i, 7; " + index + f"mul.lo.u32 %c, %c, {slots}; "
            f"add.u32 %c, %c, {slot}; mad.lo.u32 %c, %w, {wg_stride}, %c; "
            f"mul.wide.u32 %o, %c, 8; mov.u64 %a, {base}; add.u64 %a, %a, %o; "
            + load + " @%pp st.global.u64 [%a], %t; mov.u32 $0, 0; }")


def _stamp_fn(name: str, asm: str, per_tile: bool) -> str:
    arg, args, cons = ("t", "[t]", "'=r,r'") if per_tile else ("", "[]", "'=r'")
    return (f"@gluon.jit\ndef {name}({arg}):\n    gl.inline_asm_elementwise({asm!r}, {cons}, "
            f"{args}, dtype=gl.int32, is_pure=False, pack=1)\n")


def _patch(src: str, old: str, new: str) -> str:
    n = src.count(old)
    if n != 1:
        raise RuntimeError(f"stamp anchor found {n} times: {old[:80]!r}")
    return src.replace(old, new)


def _with_stamps(module, fns: list[str]) -> str:
    src = inspect.getsource(module)
    head, sep, rest = src.partition("\n@gluon.jit\n")
    return head + "\n" + "\n\n".join(fns) + "\n" + sep + rest


def bwd_source(base: int) -> str:
    fns = [_stamp_fn(f"_tl_c{i}", _asm(base, BWD_SLOTS, i, 5, False), False) for i in range(5)]
    fns += [_stamp_fn("_tl_smid", _asm(base, BWD_SLOTS, 10, 0, False, smid=True), False),
            _stamp_fn("_tl_prod", _asm(base, BWD_SLOTS, 11, 0, False), False),
            _stamp_fn("_tl_writer", _asm(base, BWD_SLOTS, 12, 0, False), False)]
    src = _with_stamps(sm90_bwd, fns)
    src = _patch(src, "    dv = gl.zeros([HALF, HEAD_D], gl.float32, layout=a_layout)\n"
                 "    if n_steps > 0:\n        mbarrier.wait(kv_bar, 0)\n",
                 "    dv = gl.zeros([HALF, HEAD_D], gl.float32, layout=a_layout)\n    _tl_c0()\n"
                 "    if n_steps > 0:\n        mbarrier.wait(kv_bar, 0)\n        _tl_c1()\n")
    src = _patch(src, "                False, 2, ROW_STATS)\n"
                 "            for t in range(1, n_steps):\n",
                 "                False, 2, ROW_STATS)\n            _tl_c2()\n"
                 "            for t in range(1, n_steps):\n")
    src = _patch(src, "    d_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, a_layout))\n"
                 "    keys = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, a_layout))\n",
                 "    _tl_c3()\n    d_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, a_layout))\n"
                 "    keys = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, a_layout))\n")
    src = _patch(src, "\n\n\n@gluon.jit\ndef _dq_writer(",
                 "\n    _tl_c4()\n\n\n@gluon.jit\ndef _dq_writer(")
    prod = ("    ld_layout: gl.constexpr = gl.BlockedLayout([ROWS // 32], [32], [1], [0])"
            "  # over one warp\n")
    src = _patch(src, prod, prod + "    _tl_smid()\n    _tl_prod()\n")
    return _patch(src, "            mbarrier.arrive(dq_empty.index(1), count=1)\n\n\n",
                  "            mbarrier.arrive(dq_empty.index(1), count=1)\n    _tl_writer()\n\n\n")


def fwd_source(base: int) -> str:
    fns = [_stamp_fn(f"_tl_f{i}", _asm(base, FWD_SLOTS, i, FWD_WG, True), True)
           for i in range(FWD_WG)]
    fns.append(_stamp_fn("_tl_fsm", _asm(base, FWD_SLOTS, 2 * FWD_WG, 0, True, smid=True), True))
    src = _with_stamps(sm90_fwd, fns)
    src = _patch(src, "    TILE_M: gl.constexpr = WGS * HALF_M\n"
                 "    start_m = (n_m - 1 - t % n_m) * TILE_M\n",
                 "    TILE_M: gl.constexpr = WGS * HALF_M\n    _tl_f0(t)\n    _tl_fsm(t)\n"
                 "    start_m = (n_m - 1 - t % n_m) * TILE_M\n")
    src = _patch(src, "    pend = _store_tile(", "    _tl_f1(t)\n    pend = _store_tile(")
    # Q's arrival and the first block inside _consume_tile, which gets the tile id as an extra
    # argument (tl_t; the one-tile consumer's call passes none: 0, its stamps unread)
    src = _patch(src, "DS_BLOCKED: gl.constexpr = False,\n"
                 "                  Q_REGS: gl.constexpr = 0):\n",
                 "DS_BLOCKED: gl.constexpr = False,\n"
                 "                  Q_REGS: gl.constexpr = 0, tl_t=0):\n")
    src = _patch(src, "        mbarrier.wait(q_bar, q_phase)\n",
                 "        mbarrier.wait(q_bar, q_phase)\n        _tl_f3(tl_t)\n")
    src = _patch(src, "        if KEEP_LAST_V >= 2:\n            _release_o_stage(",
                 "        _tl_f4(tl_t)\n        if KEEP_LAST_V >= 2:\n"
                 "            _release_o_stage(")
    src = _patch(src, "stride_vdk, DS_BLOCKED,\n                             Q_REGS)\n",
                 "stride_vdk, DS_BLOCKED,\n                             Q_REGS, tl_t=t)\n")
    return _patch(src, "    has_work = (n_tiles > 0).to(gl.int32)\n    return it + n_tiles,",
                  "    _tl_f2(t)\n    has_work = (n_tiles > 0).to(gl.int32)\n    return it + n_tiles,")


def install(kernel: str, base: int) -> None:
    """The stamped kernels in place of the module's (its launcher, looked up by the op layer at
    each call, then launches them). The source is registered with linecache: the JIT reads each
    function's source back through inspect."""
    module, _, source = KERNELS[kernel]
    src = source(base)
    name = module.__file__ + ":timeline"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    exec(compile(src, name, "exec"), module.__dict__)


# --kernel: the module, the stamped kernel's name there, its stamped source
KERNELS = {"bwd": (sm90_bwd, "_bwd_dkdv_sm90", bwd_source),
           "fwd": (sm90_fwd, "_attn_fwd_sm90", fwd_source)}


def compiled_forms(fn) -> list[dict]:
    """Registers a thread and local-memory (spill) bytes of each form of the Triton JIT function
    ``fn`` compiled in this process. The stamps change register allocation (session 21: a form
    that spilled 704 B as launched spilled 20 B stamped, another 0 B launched and 152 stamped),
    so a timeline's on / off comparison holds only where both agree with the launched forms."""
    return [{"regs": k.n_regs, "local_bytes": k.n_spills}
            for cache in fn.device_caches.values() for k in cache[0].values()]


def _us(x) -> float:
    return round(x / 1e3, 3)


def _med(xs):
    xs = [x for x in xs if x is not None]
    return _us(statistics.median(xs)) if xs else None


def _gaps(items: list[dict]) -> dict:
    """Medians of the gaps between consecutive items (CTAs, tiles) on each SM."""
    by_sm: dict[int, list] = {}
    for c in items:
        by_sm.setdefault(c["sm"], []).append(c)
    gaps, counts = [], []
    for cs in by_sm.values():
        cs.sort(key=lambda c: c["start"])
        gaps += [b["start"] - a["end"] for a, b in zip(cs, cs[1:])]
        counts.append(len(cs))
    firsts = sorted(min(c["start"] for c in cs) for cs in by_sm.values())
    return {"gap_us": {"median": _med(gaps), "max": _us(max(gaps)) if gaps else None},
            "per_sm": {"min": min(counts), "max": max(counts), "sms": len(by_sm)},
            "first_start_spread_us": _us(firsts[-1] - firsts[0]),
            "kernel_us": round((max(c["end"] for c in items) - firsts[0]) / 1e3, 1)}


def summarize_bwd(stamps: torch.Tensor) -> dict:
    ctas = []
    for r in stamps.tolist():
        if r[11] == 0:
            continue
        c = [r[0:5], r[5:10]]
        ctas.append(dict(sm=r[10], start=min(r[11], c[0][0], c[1][0]),
                         end=max(c[0][4], c[1][4], r[12]), c=c, writer=r[12]))
    out = {"ctas": len(ctas)}
    for wg in (0, 1):
        s = [c["c"][wg] for c in ctas]
        out[f"wg{wg}_us"] = {
            "start->kv": _med([x[1] - x[0] for x in s]),
            "kv->first_step": _med([x[2] - x[1] if x[2] else None for x in s]),
            "loop": _med([x[3] - (x[2] or x[1]) for x in s]),
            "epilogue": _med([x[4] - x[3] for x in s])}
    out["producer_start->wg0_start_us"] = _med([c["c"][0][0] - c["start"] for c in ctas])
    out["writer_after_stores_us"] = _med([c["writer"] - max(c["c"][0][4], c["c"][1][4])
                                          for c in ctas])
    out["cta_us"] = _med([c["end"] - c["start"] for c in ctas])
    return {**out, **_gaps(ctas)}


def summarize_fwd(stamps: torch.Tensor) -> dict:
    tiles = []
    for r in stamps.tolist():
        if r[0] == 0:
            continue
        w = [r[0:FWD_WG], r[FWD_WG:2 * FWD_WG]]
        tiles.append(dict(sm=r[2 * FWD_WG], start=min(w[0][0], w[1][0]),
                          end=max(w[0][2], w[1][2]), w=w))
    out = {"tiles": len(tiles)}
    for wg in (0, 1):
        s = [t["w"][wg] for t in tiles]
        out[f"wg{wg}_us"] = {"compute": _med([x[1] - x[0] for x in s]),
                             "q_wait": _med([x[3] - x[0] if x[3] else None for x in s]),
                             "first": _med([x[4] - x[3] if x[4] else None for x in s]),
                             "store": _med([x[2] - x[1] for x in s])}
    out["tile_us"] = _med([t["end"] - t["start"] for t in tiles])
    return {**out, **_gaps(tiles)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=("bwd", "fwd"), default="bwd")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    b, h = max(1, 16384 // a.seqlen), 2048 // a.d
    if a.kernel == "bwd":
        rows, slots = -(-a.seqlen // 128) * b * h, BWD_SLOTS
    else:
        form = sm90_fwd.launch_form(a.d, False, "causal" if a.causal else "none", a.seqlen)
        if not form["PERSISTENT"] or form["WGS"] != 2:
            raise SystemExit(f"--kernel fwd: d={a.d} runs {form}; the stamps cover the "
                             "persistent two-warpgroup forward")
        rows, slots = -(-a.seqlen // 128) * b * h, FWD_SLOTS
    stamps = torch.zeros(rows, slots, dtype=torch.int64, device="cuda")
    q, k, v = (torch.randn(b, a.seqlen, h, a.d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=a.kernel == "bwd") for _ in range(3))
    dout = torch.randn_like(q)
    module, name, _ = KERNELS[a.kernel]

    def call():
        out = ioattn.flash_attn_func(q, k, v, causal=a.causal, backend="sm90")
        if a.kernel == "bwd":
            out.backward(dout)
        torch.cuda.synchronize()

    call()  # the launched (unstamped) form, for its registers and spills
    launched = compiled_forms(getattr(module, name))
    install(a.kernel, stamps.data_ptr())
    results = {}
    for i in range(4):
        stamps.zero_()
        torch.cuda.synchronize()
        call()
        if i >= 2:
            results[f"call{i}"] = (summarize_bwd if a.kernel == "bwd" else summarize_fwd)(
                stamps.cpu())
    stamped = compiled_forms(getattr(module, name))
    if launched != stamped:
        print(f"note: the stamped kernel's registers / spills {stamped} differ from the launched "
              f"one's {launched}: its times may not be the launched kernel's")
    summary = {"kernel": a.kernel, "d": a.d, "seqlen": a.seqlen, "batch": b, "heads": h,
               "causal": a.causal, **results, "launched_forms": launched,
               "stamped_forms": stamped,
               "bwd_dq_order": sm90_bwd.dq_order(a.d, a.causal),
               "bwd_tma_store": sm90_bwd.TMA_STORE, "fwd_o_tma": sm90_fwd.O_TMA,
               "fwd_q_bufs": sm90_fwd.Q_BUFS,
               "fwd_pingpong": sm90_fwd.PINGPONG,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "date": datetime.date.today().isoformat(),
               "commit": os.environ.get("IOATTN_GIT_COMMIT", "unknown")}
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()

"""Benchmark runner: times every implementation side by side on each grid cell, writes JSON + plots.

Usage: ``python -m ioattn bench [options]`` or ``python -m ioattn.bench.runner [options]``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch

from . import anchors
from .shapes import DIMS, FLOPS_FORMULA, HIDDEN, QUICK_DIMS, QUICK_SEQLENS, SEQLENS, TOKENS, Shape, fa_grid

CELL_KEYS = ("mode", "d", "h", "s", "b", "causal", "dtype", "d_v")
ABBREV = {"ioattn": "io", "ioattn_triton": "io-tri", "ioattn_sm90": "io-sm90", "ioattn_fp8": "io-fp8", "ioattn_fp8_head": "io-fp8h", "ioattn_fp8_vrows": "io-fp8vr", "ioattn_sdpa": "io-sdpa", "sdpa_cudnn": "cudnn", "sdpa_flash": "flash", "flex": "flex", "sdpa_math": "math"}


@dataclass
class Row:
    mode: str
    d: int
    h: int
    s: int
    b: int
    causal: bool
    dtype: str
    impl: str
    d_v: Optional[int] = None  # V's head dim where it differs from d
    ms: Optional[float] = None
    tflops: Optional[float] = None
    error: Optional[str] = None
    max_abs_err: Optional[float] = None  # forward output vs. `ref`
    max_abs_err_dq: Optional[float] = None  # bwd cells: dq vs. `ref`
    ref: Optional[str] = None
    ms_rounds: Optional[list] = None  # (rounds > 1) each round's median ms, in timing order

    def cell(self) -> tuple:
        return tuple(getattr(self, k) for k in CELL_KEYS)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


# ---------------------------------------------------------------- timing

def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, rep: int,
            leaves: list[torch.Tensor]) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=leaves or None, return_mode="median")
    # CPU smoke path: wall-clock median; warmup/rep are time budgets in ms like do_bench's.
    times: list[float] = []
    t_warm = time.perf_counter() + warmup / 1e3
    while True:
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if t1 >= t_warm:
            times.append((t1 - t0) * 1e3)
            if len(times) >= 3 and (t1 >= t_warm + rep / 1e3 or len(times) >= 1000):
                return statistics.median(times)


def _err_str(e: BaseException) -> str:
    msg = " ".join(str(e).split())  # one line: tracebacks of compilers are long
    return f"{type(e).__name__}: {msg[:300]}"


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def run_cell(shape: Shape, impl_names: list[str], device: torch.device, warmup: int, rep: int,
             rounds: int = 1) -> list[Row]:
    """Time every impl on one cell. With rounds > 1 the impls are timed in turn, round after
    round (each round rep / rounds ms), and each keeps the median of its rounds: a drift of the
    GPU's clocks during the cell then falls on every impl alike instead of on whichever ran
    last."""
    inp = anchors.make_inputs(shape, device)
    outs: dict[str, torch.Tensor] = {}
    dqs: dict[str, torch.Tensor] = {}
    rows, ready = [], []
    for name in impl_names:
        impl = anchors.IMPLS[name]
        row = Row(**{k: getattr(shape, k) for k in CELL_KEYS}, impl=name)
        rows.append(row)
        if impl.needs_cuda and device.type != "cuda":
            row.error = "needs CUDA"
            continue
        try:
            with impl.context():
                ready.append((row, impl, anchors.prepare(impl, inp, shape)))
        except Exception as e:  # a refusal/failure for one impl must never stop the grid
            row.error = _err_str(e)
    times: dict[str, list[float]] = {row.impl: [] for row, _, _ in ready}
    for _ in range(max(1, rounds)):
        for row, impl, p in ready:
            if row.error is not None:
                continue
            try:
                with impl.context():
                    for t in p.leaves:  # anchors share bhsd leaves: never accumulate into another's grad
                        t.grad = None
                    times[row.impl].append(time_ms(p.fn, device, warmup, max(1, rep // max(1, rounds)),
                                                   p.leaves))
                outs[row.impl] = p.out.detach()
                if p.leaves and p.leaves[0].grad is not None:
                    dqs[row.impl] = p.to_bshd(p.leaves[0].grad).clone()
            except Exception as e:
                row.error = _err_str(e)
            finally:
                for t in p.leaves:
                    t.grad = None
    for row, _, _ in ready:
        if row.error is None and times[row.impl]:
            row.ms = statistics.median(times[row.impl])
            row.tflops = shape.flops() / row.ms / 1e9
            if len(times[row.impl]) > 1:  # the spread within the cell, kept for the notes
                row.ms_rounds = [round(t, 5) for t in times[row.impl]]
        else:
            outs.pop(row.impl, None)
            dqs.pop(row.impl, None)
    _check(rows, outs, dqs)
    del inp, outs, dqs, ready
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _check(rows: list[Row], outs: dict, dqs: dict) -> None:
    """Every impl that ran is compared with one reference (cudnn preferred) on the same data."""
    ref = next((n for n in anchors.REF_ORDER if n in outs), None)
    ref = ref or next((n for n in outs if n != "ioattn"), None)
    if ref is None:
        return
    for row in rows:
        if row.impl in outs and row.impl != ref:
            row.ref = ref
            row.max_abs_err = _max_abs(outs[row.impl], outs[ref])
            if row.impl in dqs and ref in dqs:
                row.max_abs_err_dq = _max_abs(dqs[row.impl], dqs[ref])


# ---------------------------------------------------------------- results document

def compute_ratios(rows: list[Row]) -> tuple[list[dict], list[dict]]:
    """ratio = ioattn TFLOP/s / anchor TFLOP/s (= anchor ms / ioattn ms); >1 means ioattn is faster."""
    by_cell: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_cell.setdefault(r.cell(), {})[r.impl] = r
    ratios, logs = [], {}
    for cell, impls in by_cell.items():
        io = impls.get("ioattn")
        if io is None or io.tflops is None:
            continue
        vs = {n: io.tflops / r.tflops for n, r in impls.items() if n != "ioattn" and r.tflops}
        ratios.append({**{k: v for k, v in zip(CELL_KEYS, cell) if v is not None},
                       "ioattn_tflops": io.tflops, "vs": vs})
        for n, x in vs.items():
            logs.setdefault((cell[0], cell[6], n), []).append(math.log(x))
    geo = [{"mode": m, "dtype": dt, "anchor": n, "geomean": math.exp(sum(v) / len(v)), "cells": len(v)}
           for (m, dt, n), v in logs.items()]
    return ratios, geo


def _git_commit() -> Optional[str]:
    # the device machine runs a copy of the work tree without .git: the caller can pass the commit
    if os.environ.get("IOATTN_GIT_COMMIT"):
        return os.environ["IOATTN_GIT_COMMIT"]
    try:
        cwd = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def collect_env(device: torch.device) -> dict:
    try:
        import triton

        triton_v: Optional[str] = triton.__version__
    except ImportError:
        triton_v = None
    env = {"device": device.type, "gpu": None, "sm_count": None, "torch": torch.__version__,
           "triton": triton_v, "cuda": torch.version.cuda, "cudnn": None,
           "python": platform.python_version(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "git_commit": _git_commit(), "host_cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        env.update(gpu=prop.name, sm_count=prop.multi_processor_count,
                   capability=f"{prop.major}.{prop.minor}", cudnn=torch.backends.cudnn.version())
    return env


def default_json_path(out: Optional[str], env: dict) -> Path:
    if out and out.endswith(".json"):
        return Path(out)
    slug = re.sub(r"[^a-z0-9]+", "-", (env["gpu"] or env["device"]).lower()).strip("-")
    return Path(out or "benchmarks/results") / f"dense_{slug}_{env['date'][:10]}.json"


def build_doc(rows: list[Row], env: dict, method: dict, args: dict) -> dict:
    ratios, geo = compute_ratios(rows)
    return {"env": env, "method": method, "args": args, "rows": [r.to_json() for r in rows],
            "ratios": ratios, "ratios_geomean": geo}


def load_rows(path: Path) -> list[Row]:
    names = {f.name for f in fields(Row)}
    doc = json.loads(path.read_text())
    return [Row(**{k: v for k, v in r.items() if k in names}) for r in doc.get("rows", [])]


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")  # atomic: a killed run never leaves a truncated file
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


# ---------------------------------------------------------------- summary

def summary_table(rows: list[Row], impls: list[str]) -> str:
    """One line per cell: TFLOP/s per impl, ratio ioattn/anchor, ioattn max abs err."""
    anchors_ = [n for n in impls if n != "ioattn"]
    head = f"{'cell':<24}" + "".join(f"{ABBREV.get(n, n)[:7]:>8}" for n in impls)
    if "ioattn" in impls:
        head += "".join(f"{'io/' + ABBREV.get(n, n)[:5]:>9}" for n in anchors_) + f"{'io_err':>9}"
    by_cell: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_cell.setdefault(r.cell(), {})[r.impl] = r
    lines = ["TFLOP/s (ratio = ioattn/anchor TFLOP/s, >1: ioattn faster)", head]
    for cell, got in by_cell.items():
        m, d, _, s, _, c, dt, d_v = cell
        dims = f"d{d}" + (f"x{d_v}" if d_v else "")
        line = f"{m} {dt} {dims} s{s} {'C' if c else 'N'}".ljust(24)
        line += "".join(f"{got[n].tflops:8.1f}" if n in got and got[n].tflops else f"{'err':>8}" for n in impls)
        io = got.get("ioattn")
        if io is not None:
            for n in anchors_:
                ok = io.tflops and n in got and got[n].tflops
                line += f"{io.tflops / got[n].tflops:9.2f}" if ok else f"{'-':>9}"
            line += f"{io.max_abs_err:9.1e}" if io.max_abs_err is not None else f"{'-':>9}"
        lines.append(line)
    _, geo = compute_ratios(rows)
    for g in geo:
        lines.append(f"geomean ioattn/{g['anchor']} {g['mode']} {g['dtype']}: {g['geomean']:.3f} ({g['cells']} cells)")
    errs: dict[tuple, int] = {}
    for r in rows:
        if r.error and r.error != "needs CUDA":
            errs[(r.impl, r.error[:110])] = errs.get((r.impl, r.error[:110]), 0) + 1
    for (n, e), k in list(errs.items())[:12]:
        lines.append(f"error {n} x{k}: {e}")
    return "\n".join(lines)


REPORT_NAMES = {"sdpa_cudnn": "cuDNN", "sdpa_flash": "FA2", "flex": "Flex",
                "ioattn_triton": "ioattn portable", "sdpa_math": "SDPA math"}


def report_markdown(rows: list[Row], min_seqlen: int = 2048, reference: str = "sdpa_cudnn") -> str:
    """A run's cells from ``min_seqlen`` as markdown tables, one per (mode, dtype): TFLOP/s of
    ioattn and each anchor in the run, ioattn's ratio to each; under each table how many cells
    reach 1.0 against ``reference`` (the others listed) and the ratio's range per head dim.
    (The README's performance tables are this output less the portable kernels' column.)"""
    by_cell: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        if r.s >= min_seqlen and r.tflops:
            by_cell.setdefault(r.cell(), {})[r.impl] = r
    groups: dict[tuple, list[tuple]] = {}
    for cell in by_cell:
        m, _, _, _, _, _, dt, _ = cell
        groups.setdefault((m, dt), []).append(cell)
    out = []
    for (mode, dt), cells in sorted(groups.items(), key=lambda g: (g[0][0] != "fwd", g[0])):
        cells.sort(key=lambda c: (c[1], c[7] or 0, c[5], c[3]))  # d, d_v, causal, s
        anchors_ = [n for n in REPORT_NAMES if any(n in by_cell[c] for c in cells)]
        names = [REPORT_NAMES[n] for n in anchors_]
        out += [f"{'Forward' if mode == 'fwd' else 'Backward'}, {dt}:", "",
                "| d | causal | s | ioattn | " + " | ".join(names) + " | "
                + " | ".join(f"vs {n}" for n in names) + " |",
                "|" + "---|" * (4 + 2 * len(names))]
        below, ranges, n_ok, n_ref = [], {}, 0, 0
        for c in cells:
            got = by_cell[c]
            io = got.get("ioattn")
            if io is None:
                continue
            _, d, _, s, _, causal, _, d_v = c
            dims = f"{d}" + (f"x{d_v}" if d_v else "")
            seq = f"{s // 1024}k" if s % 1024 == 0 else str(s)
            vals = [f"{got[n].tflops:.0f}" if n in got else "-" for n in anchors_]
            ratio = [f"{io.tflops / got[n].tflops:.2f}" if n in got else "-" for n in anchors_]
            out.append(f"| {dims} | {'yes' if causal else 'no'} | {seq} | {io.tflops:.0f} | "
                       + " | ".join(vals) + " | " + " | ".join(ratio) + " |")
            if reference in got:
                r = io.tflops / got[reference].tflops
                n_ref += 1
                n_ok += r >= 1.0
                ranges.setdefault(dims, []).append(r)
                if r < 1.0:
                    below.append(f"d={dims} {'causal' if causal else 'non-causal'} {seq} {r:.3f}")
        if n_ref:
            ref = REPORT_NAMES.get(reference, reference)
            out += ["", f"{n_ok} of {n_ref} cells at or above 1.0x {ref}"
                    + (f"; below: {', '.join(below)}" if below else "") + "; ratio by head dim: "
                    + ", ".join(f"d={k} {min(v):.2f}-{max(v):.2f}" for k, v in ranges.items())]
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- CLI

def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _dims(s: str) -> list:
    """Head dims: 64,128 or, with V's head dim, 192x128."""
    out = []
    for x in s.split(","):
        if "x" in x:
            d, d_v = (int(y) for y in x.split("x"))
            out.append(d if d == d_v else (d, d_v))
        elif x:
            out.append(int(x))
    return out


def _strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ioattn bench", description=__doc__.splitlines()[0])
    p.add_argument("--modes", type=_strs, default=["fwd", "bwd"], help="fwd,bwd")
    p.add_argument("--dims", type=_dims, default=None,
                   help=f"head dims (default {DIMS}); DxDV for V's head dim DV != D, e.g. 192x128")
    p.add_argument("--seqlens", type=_ints, default=None, help=f"default {SEQLENS}")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--dtypes", type=_strs, default=["bf16"], help="bf16[,fp16]")
    p.add_argument("--impls", type=_strs, default=list(anchors.DEFAULT_IMPLS),
                   help=f"any of {','.join(anchors.IMPLS)}")
    p.add_argument("--out", default=None, help="output dir (default benchmarks/results) or a .json path")
    p.add_argument("--quick", action="store_true", help=f"reduced grid: dims {QUICK_DIMS}, seqlens {QUICK_SEQLENS}")
    p.add_argument("--tokens", type=int, default=TOKENS, help="batch*seqlen per cell")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="heads*d per cell")
    p.add_argument("--warmup", type=int, default=25, help="warmup ms (do_bench)")
    p.add_argument("--rep", type=int, default=100, help="measurement ms (do_bench)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the impls in turn this many times per cell (rep split among rounds), "
                        "keep each one's median")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--merge", action="store_true", help="merge into an existing JSON (new rows replace old)")
    p.add_argument("--resume", action="store_true", help="--merge and skip cells already in the JSON")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--softcap", type=float, default=0.0,
                   help="cap * tanh(score / cap) in every cell (SDPA has none: its rows say so); "
                        "write such a run to its own --out")
    a = p.parse_args(argv)
    if a.softcap < 0:
        p.error(f"--softcap {a.softcap}: expected a cap > 0, or 0 for none")
    a.dims = a.dims or list(QUICK_DIMS if a.quick else DIMS)
    a.seqlens = a.seqlens or list(QUICK_SEQLENS if a.quick else SEQLENS)
    bad = [n for n in a.impls if n not in anchors.IMPLS]
    if bad:
        p.error(f"unknown impls {bad}; choose from {list(anchors.IMPLS)}")
    return a


def _progress(shapes: list[Shape]) -> Iterator[Shape]:
    try:
        from tqdm import tqdm
    except ImportError:
        for i, s in enumerate(shapes, 1):
            print(f"\r[{i}/{len(shapes)}] {s.label():<30}", end="", file=sys.stderr, flush=True)
            yield s
        print(file=sys.stderr)
        return
    # Not a TTY (captured log): refresh rarely so the bar does not bury the summary table.
    bar = tqdm(shapes, unit="cell", file=sys.stderr, dynamic_ncols=True,
               mininterval=0.1 if sys.stderr.isatty() else 30.0)
    for s in bar:
        bar.set_postfix_str(s.label(), refresh=False)
        yield s


def main(argv: Optional[Iterable[str]] = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    if "--report" in argv:  # --report RUN.json [--from S]: a run's markdown tables, no timing
        rp = argparse.ArgumentParser(prog="python -m ioattn bench --report")
        rp.add_argument("--report", type=Path, required=True, help="a results JSON of this command")
        rp.add_argument("--from", dest="min_seqlen", type=int, default=2048,
                        help="the shortest sequence length to list (default 2048)")
        ra = rp.parse_args(argv)
        if not ra.report.is_file():
            rp.error(f"--report {ra.report}: no such file; pass a JSON that `python -m ioattn "
                     "bench` wrote")
        print(report_markdown(load_rows(ra.report), ra.min_seqlen))
        return 0
    if "--suite" in argv:  # --suite dense (this grid, the default) | decode (ioattn.bench.decode)
        i = argv.index("--suite")
        suite = argv[i + 1] if i + 1 < len(argv) else ""
        argv = argv[:i] + argv[i + 2:]
        if suite == "decode":
            from .decode import main as decode_main

            return decode_main(argv)
        if suite != "dense":
            raise SystemExit(f"--suite {suite!r}: choose dense or decode")
    a = parse_args(argv)
    device = torch.device(a.device)
    causals = {"both": [False, True], "true": [True], "false": [False]}[a.causal]
    shapes = fa_grid(a.tokens, a.hidden, a.dims, a.seqlens, causals, a.dtypes, a.modes, a.softcap)
    env = collect_env(device)
    path = default_json_path(a.out, env)
    timer = (f"triton.testing.do_bench(warmup={a.warmup}, rep={a.rep}, return_mode='median')"
             if device.type == "cuda" else f"time.perf_counter median (warmup {a.warmup} ms, rep {a.rep} ms)")
    if a.rounds > 1:
        timer += (f"; impls timed in turn in {a.rounds} rounds of rep/{a.rounds} ms, median of rounds "
                  "(each round's in ms_rounds)")
    method = {"flops": FLOPS_FORMULA, "timer": timer, "tokens": a.tokens, "hidden": a.hidden,
              "softcap": a.softcap,
              "ratio": "ioattn TFLOP/s / anchor TFLOP/s", "check": "max abs err of output (and dq in bwd) vs ref"}
    old: list[Row] = load_rows(path) if (a.merge or a.resume) and path.exists() else []
    if a.resume:
        done = {(r.cell(), r.impl) for r in old}
        shapes = [s for s in shapes if any((_cell(s), n) not in done for n in a.impls)]
    rows: list[Row] = []

    def merged() -> list[Row]:
        new = {(r.cell(), r.impl) for r in rows}
        return [r for r in old if (r.cell(), r.impl) not in new] + rows

    if device.type == "cuda" and shapes:
        _warm_gpu(device)
    try:
        for shape in _progress(shapes):
            rows += run_cell(shape, a.impls, device, a.warmup, a.rep, a.rounds)
            write_json(path, build_doc(merged(), env, method, vars(a)))  # survive a killed run
    except KeyboardInterrupt:
        print("interrupted; writing partial results", file=sys.stderr)
    doc = build_doc(merged(), env, method, vars(a))
    if not a.no_plots:
        try:
            from . import plots

            doc["plots"] = [p.name for p in plots.save_plots(doc, path)]
        except ImportError as e:  # matplotlib missing: JSON is still the result of record
            print(f"plots skipped: {e}", file=sys.stderr)
    write_json(path, doc)
    print(summary_table(merged(), a.impls))
    print(f"results: {path}")
    return 0


def _warm_gpu(device: torch.device, seconds: float = 3.0) -> None:
    """Run matmuls until clocks leave idle, so the first cell is not timed on a cold GPU
    (seen on the H200: the first cell of a run measured at 0.34x its rerun)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)


def _cell(s: Shape) -> tuple:
    return tuple(getattr(s, k) for k in CELL_KEYS)


if __name__ == "__main__":
    sys.exit(main())

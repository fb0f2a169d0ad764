"""CPU smoke test of the benchmark harness, with ioattn replaced by a PyTorch stand-in."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch.nn.functional as F

try:
    import ioattn  # noqa: F401
except Exception:
    # ioattn/__init__.py is edited concurrently; if it is broken, register a bare package so the
    # bench subpackage (which needs nothing from it here, thanks to the stand-in) still imports.
    _pkg = types.ModuleType("ioattn")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "ioattn")]
    sys.modules["ioattn"] = _pkg

from ioattn.bench import anchors, runner  # noqa: E402


def standin_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale
    )
    return out.transpose(1, 2)


ARGS = ["--device", "cpu", "--tokens", "256", "--hidden", "64", "--dims", "32", "--seqlens", "64,128",
        "--impls", "ioattn,sdpa_math,sdpa_cudnn", "--warmup", "1", "--rep", "5"]


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.setattr(anchors, "get_ioattn_func", lambda: standin_flash_attn_func)


def test_cpu_smoke(patched, tmp_path, capsys):
    assert runner.main(ARGS + ["--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("dense_cpu_*.json")
    doc = json.loads(path.read_text())

    assert {"torch", "python", "date", "gpu", "git_commit"} <= set(doc["env"])
    assert doc["method"]["tokens"] == 256
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 2 * 3  # modes x seqlens x causal x impls
    ok = [r for r in rows if r["impl"] in ("ioattn", "sdpa_math")]
    assert all(r["ms"] > 0 and r["tflops"] > 0 and "error" not in r for r in ok), ok
    assert all(r["error"] == "needs CUDA" for r in rows if r["impl"] == "sdpa_cudnn")
    io = [r for r in rows if r["impl"] == "ioattn"]
    assert all(r["ref"] == "sdpa_math" and r["max_abs_err"] < 1e-2 for r in io)
    assert all(r["max_abs_err_dq"] < 5e-2 for r in io if r["mode"] == "bwd")
    # b = tokens // s, h = hidden // d, causal halves the FLOPs
    r = next(r for r in io if r["s"] == 64 and r["mode"] == "fwd" and r["causal"])
    assert (r["b"], r["h"]) == (4, 2)
    assert r["tflops"] == pytest.approx(4 * 4 * 2 * 64 * 64 * 32 / 2 / r["ms"] / 1e9)

    assert len(doc["ratios"]) == 8
    assert all(set(x["vs"]) == {"sdpa_math"} for x in doc["ratios"])
    assert {(g["mode"], g["anchor"]) for g in doc["ratios_geomean"]} == {("fwd", "sdpa_math"), ("bwd", "sdpa_math")}
    if importlib.util.find_spec("matplotlib") is not None:
        for mode in ("fwd", "bwd"):
            assert path.with_name(f"{path.stem}_{mode}_bf16.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "geomean ioattn/sdpa_math" in out and len(out) < 12000


def test_impl_failure_is_recorded(monkeypatch, tmp_path):
    def broken(*a, **k):
        raise RuntimeError("kernel refused this shape")

    monkeypatch.setattr(anchors, "get_ioattn_func", lambda: broken)
    out = tmp_path / "x.json"
    assert runner.main(ARGS + ["--modes", "fwd", "--no-plots", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all("kernel refused" in r["error"] for r in rows if r["impl"] == "ioattn")
    assert all("ms" in r for r in rows if r["impl"] == "sdpa_math")


def test_rounds_interleave_impls(patched, monkeypatch):
    """--rounds N times the impls in turn, N times per cell (rep split among the rounds), and
    keeps each impl's median round."""
    from ioattn.bench.shapes import Shape

    calls = []
    fake = iter([3.0, 1.0, 5.0, 2.0, 9.0, 4.0])  # ioattn, sdpa_math, ioattn, ...

    def timed(fn, device, warmup, rep, leaves):
        calls.append(rep)
        fn()
        return next(fake)

    monkeypatch.setattr(runner, "time_ms", timed)
    rows = runner.run_cell(Shape("bwd", 32, 2, 64, 4, True, "bf16"), ["ioattn", "sdpa_math"],
                           runner.torch.device("cpu"), 1, 30, rounds=3)
    assert calls == [10] * 6
    ms = {r.impl: r.ms for r in rows}
    assert ms == {"ioattn": 5.0, "sdpa_math": 2.0}
    # each round's time kept, in timing order (the spread within the cell)
    assert {r.impl: r.ms_rounds for r in rows} == {"ioattn": [3.0, 5.0, 9.0],
                                                  "sdpa_math": [1.0, 2.0, 4.0]}
    io = next(r for r in rows if r.impl == "ioattn")
    assert io.ref == "sdpa_math" and io.max_abs_err < 1e-2 and io.max_abs_err_dq < 5e-2


def test_resume_skips_done_cells(patched, tmp_path):
    out = tmp_path / "r.json"
    runner.main(ARGS + ["--modes", "fwd", "--seqlens", "64", "--no-plots", "--out", str(out)])
    runner.main(ARGS + ["--modes", "fwd", "--resume", "--no-plots", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 3  # s=64 kept, s=128 added, nothing duplicated


def test_flops_formula():
    from ioattn.bench.shapes import Shape, fa_grid

    grid = fa_grid()
    assert len(grid) == 3 * 6 * 2 * 2
    assert {(s.d, s.h) for s in grid} == {(64, 32), (128, 16), (256, 8)}
    fwd = Shape("fwd", 128, 16, 4096, 4, False, "bf16")
    assert fwd.flops() == 4 * 4 * 16 * 4096 * 4096 * 128
    assert Shape("bwd", 128, 16, 4096, 4, True, "bf16").flops() == 2.5 * fwd.flops() / 2


def test_value_head_dim_cells(patched, tmp_path, capsys):
    """--dims 32x16: V (and O) at 16 columns, q and k at 32; FLOPs 2*b*h*s*s*(d + d_v); rows and
    ratios carry d_v, the summary names the cell d32x16; a d = d_v entry has no d_v."""
    from ioattn.bench.shapes import Shape

    out = tmp_path / "dv.json"
    args = [a if a != "32" else "32x16,32x32" for a in ARGS]
    assert runner.main(args + ["--modes", "fwd", "--seqlens", "64", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    io = [r for r in doc["rows"] if r["impl"] == "ioattn"]
    assert sorted(r.get("d_v", 0) for r in io) == [0, 0, 16, 16]
    assert all(r["max_abs_err"] < 1e-2 for r in io)
    r = next(r for r in io if r.get("d_v") == 16 and not r["causal"])
    assert r["tflops"] == pytest.approx(2 * 4 * 2 * 64 * 64 * (32 + 16) / r["ms"] / 1e9)
    assert sorted(x.get("d_v", 0) for x in doc["ratios"]) == [0, 0, 16, 16]
    assert "fwd bf16 d32x16 s64 N" in capsys.readouterr().out
    assert Shape("fwd", 192, 8, 1024, 2, False, "bf16", d_v=128).flops() == \
        2 * 2 * 8 * 1024 * 1024 * (192 + 128)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the decode kernels run on CPU only under the Triton interpreter")
def test_decode_suite_cpu(tmp_path, capsys):
    """The decode suite's plumbing on CPU (interpreter, tiny cells); SDPA anchors run on CPU too."""
    out = tmp_path / "decode.json"
    assert runner.main(["--suite", "decode", "--cells", "2x64x4", "--prefill-cells", "1x32x16x16",
                        "--heads", "4,2", "--dim", "32", "--warmup", "1", "--rep", "3",
                        "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    paged = [r for r in rows if r["impl"] == "ioattn_paged"]
    assert paged and "tb_s" in paged[0] and paged[0]["max_abs_err"] < 0.05
    for name in ("ioattn_paged_fp8", "ioattn_kvcache_fp8"):  # (kvcache: q in e4m3 too)
        fp8 = [r for r in rows if r["impl"] == name]
        assert fp8 and "tb_s" in fp8[0] and fp8[0]["max_abs_err"] < 0.25  # e4m3 rounding
    graphs = [r for r in rows if r["impl"].endswith(("_graph", "_graphloop"))]
    assert any(r["impl"].endswith("_graphloop") for r in graphs)
    assert all(r["error"] == "RuntimeError: needs CUDA" for r in graphs)
    assert any(r["kind"] == "chunked_prefill" and "tflops" in r for r in rows)
    assert any(r["impl"] == "ioattn_varlen_paged" and "tflops" in r for r in rows)


def test_cpu_softcap_run(monkeypatch, tmp_path):
    """--softcap reaches ioattn's call in every cell; SDPA, which has none, says so in its rows
    (and the grid goes on); the run records the cap."""
    caps = []

    def standin(q, k, v, causal=False, softcap=0.0, **_):
        caps.append(softcap)
        return standin_flash_attn_func(q, k, v, causal=causal)

    monkeypatch.setattr(anchors, "get_ioattn_func", lambda: standin)
    args = ARGS[:ARGS.index("--impls")] + ["--impls", "ioattn,sdpa_math", "--warmup", "1", "--rep",
                                           "5", "--softcap", "5", "--modes", "fwd"]
    assert runner.main(args + ["--out", str(tmp_path), "--no-plots"]) == 0
    (path,) = tmp_path.glob("dense_cpu_*.json")
    doc = json.loads(path.read_text())
    assert doc["method"]["softcap"] == 5.0
    assert caps and set(caps) == {5.0}
    rows = doc["rows"]
    assert all("ms" in r for r in rows if r["impl"] == "ioattn")
    assert all("softcap" in r["error"] for r in rows if r["impl"] == "sdpa_math")
    with pytest.raises(SystemExit):
        runner.main(args[:-2] + ["--softcap", "-1", "--out", str(tmp_path)])


def test_report_markdown(tmp_path, capsys):
    """`bench --report RUN.json`: a run's cells from --from on as markdown tables with ioattn's
    ratios, and under each how many cells reach cuDNN (the others named)."""
    rows = [runner.Row("fwd", 64, 32, s, 16384 // s, c, "bf16", impl, tflops=t)
            for s in (1024, 2048, 4096) for c in (False, True)
            for impl, t in (("ioattn", 500.0 if c else 380.0), ("sdpa_cudnn", 450.0),
                            ("flex", 400.0))]
    rows.append(runner.Row("fwd", 64, 32, 4096, 4, True, "bf16", "sdpa_flash", error="boom"))
    path = tmp_path / "run.json"
    runner.write_json(path, {"rows": [r.to_json() for r in rows]})
    assert runner.main(["--report", str(path), "--from", "2048"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Forward, bf16:")
    assert "| d | causal | s | ioattn | cuDNN | Flex | vs cuDNN | vs Flex |" in out
    assert "| 64 | no | 2k | 380 | 450 | 400 | 0.84 | 0.95 |" in out
    assert "1k" not in out and "FA2" not in out  # below --from; an anchor that only errored
    assert ("2 of 4 cells at or above 1.0x cuDNN; below: d=64 non-causal 2k 0.844, "
            "d=64 non-causal 4k 0.844; ratio by head dim: d=64 0.84-1.11") in out
    with pytest.raises(SystemExit):
        runner.main(["--report", str(tmp_path / "missing.json")])

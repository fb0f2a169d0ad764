"""PNG plots in the style of the FlashAttention papers: TFLOP/s vs. seqlen, bar group per impl."""
from __future__ import annotations

from pathlib import Path


def _dims(r: dict) -> tuple:
    return r["d"], r.get("d_v") or r["d"]


def _series(rows: list[dict], mode: str, dtype: str, causal: bool, d: tuple) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        if (r["mode"], r["dtype"], r["causal"], _dims(r)) == (mode, dtype, causal, d):
            out.setdefault(r["impl"], {})[r["s"]] = r.get("tflops") or 0.0  # failed cell: empty bar
    return out


def save_plots(doc: dict, json_path: Path) -> list[Path]:
    """One figure per (mode, dtype): rows = causal False/True, cols = head dim. Returns PNG paths."""
    import matplotlib

    matplotlib.use("Agg")  # headless GPU box: never need a display
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    gpu = doc["env"].get("gpu") or doc["env"].get("device", "")
    saved = []
    for mode, dtype in sorted({(r["mode"], r["dtype"]) for r in rows}):
        sub = [r for r in rows if r["mode"] == mode and r["dtype"] == dtype]
        causals = sorted({r["causal"] for r in sub})
        dims = sorted({_dims(r) for r in sub})
        impls = list(dict.fromkeys(r["impl"] for r in sub))  # keep run order for colours
        fig, axes = plt.subplots(len(causals), len(dims), squeeze=False,
                                 figsize=(4.8 * len(dims), 3.4 * len(causals)))
        for i, causal in enumerate(causals):
            for j, d in enumerate(dims):
                _bars(axes[i][j], _series(sub, mode, dtype, causal, d), impls)
                name = f"{d[0]}" if d[0] == d[1] else f"{d[0]}/{d[1]}"
                axes[i][j].set_title(f"{mode}, causal={causal}, d={name}", fontsize=9)
        axes[0][0].legend(fontsize=7, loc="upper left")
        fig.suptitle(f"{gpu} {dtype} {mode} — TFLOP/s vs seqlen", fontsize=11)
        fig.tight_layout()
        path = json_path.with_name(f"{json_path.stem}_{mode}_{dtype}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        saved.append(path)
    return saved


def _bars(ax, series: dict[str, dict[int, float]], impls: list[str]) -> None:
    seqlens = sorted({s for v in series.values() for s in v})
    width = 0.8 / max(len(impls), 1)
    for k, name in enumerate(impls):
        vals = [series.get(name, {}).get(s, 0.0) for s in seqlens]
        xs = [x + (k - (len(impls) - 1) / 2) * width for x in range(len(seqlens))]
        bars = ax.bar(xs, vals, width, label=name)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "" for v in vals], fontsize=5, rotation=90, padding=1)
    ax.set_xticks(range(len(seqlens)), [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens], fontsize=8)
    ax.set_xlabel("seqlen", fontsize=8)
    ax.set_ylabel("TFLOP/s", fontsize=8)
    ax.margins(y=0.15)  # room for the value labels


if __name__ == "__main__":  # re-plot a JSON, e.g. one left by a run killed before its plots
    import json
    import sys

    for arg in sys.argv[1:]:
        print(*save_plots(json.loads(Path(arg).read_text()), Path(arg)), sep="\n")

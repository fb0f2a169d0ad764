"""Greedy-schedule simulation of the sm90 kernels' causal work orders (no GPU).

The sm90 forward's dynamic tile counter and the one-CTA-per-block grids hand work to whichever
slot frees first, in a fixed order: list scheduling. This prints the makespan over the ideal
(total work / slots) for the FA grid's causal shapes (16k tokens, hidden 2048) in today's order
(one head after another, each head's heaviest block first) and in the grouped heaviest-first
order (``ioattn.dense.sm90_common.grouped_order`` with ``head_group_size``'s group). A block's
cost is its key (or query) blocks under the causal mask plus ``--fixed`` blocks a CTA.

    python benchmarks/schedule_sim.py [--slots 132] [--fixed 0.5] [--json out.json]
"""
from __future__ import annotations

import argparse
import heapq
import json

from ioattn.dense.sm90_common import head_group_size


def makespan(costs: list[float], slots: int) -> float:
    """List scheduling: each job in order goes to the slot that frees first."""
    free = [0.0] * slots
    heapq.heapify(free)
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def order(n_blocks: int, n_heads: int, group: int, fixed: float) -> list[float]:
    """Costs in launch order: heads in groups of ``group``, each group's blocks rank by rank
    across its heads (rank 0 the heaviest: n_blocks blocks of work under the mask); group 1 is
    one head after another."""
    costs = []
    for g0 in range(0, n_heads, group):
        for rank in range(n_blocks):
            costs += [n_blocks - rank + fixed] * min(group, n_heads - g0)
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=132, help="CTAs running at once (SMs x CTAs/SM)")
    ap.add_argument("--fixed", type=float, default=0.5, help="a CTA's fixed cost, in blocks")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for d, heads in ((64, 32), (128, 16), (256, 8)):
        for s in (2048, 4096, 8192, 16384):
            n_blocks, n_bh = s // 128, (16384 // s) * heads
            ideal = sum(order(n_blocks, n_bh, 1, a.fixed)) / a.slots
            group = head_group_size(n_bh, n_blocks, a.slots)
            today = makespan(order(n_blocks, n_bh, 1, a.fixed), a.slots) / ideal
            grouped = makespan(order(n_blocks, n_bh, group, a.fixed), a.slots) / ideal
            rows.append(dict(d=d, s=s, blocks=n_blocks, heads=n_bh, group=group,
                             today=round(today, 4), grouped=round(grouped, 4)))
            print(f"d={d:3d} s={s:5d} blocks {n_blocks:3d} heads {n_bh:3d}: one head after another "
                  f"{today:.3f}x the ideal, grouped ({group} heads) {grouped:.3f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(slots=a.slots, fixed=a.fixed, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

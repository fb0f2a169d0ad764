"""Where the GPU's block scheduler puts a grid's working CTAs when the rest of the grid exits at
once (session 26: the sm90 decode replayed in a CUDA graph ran 16 x 8k at 3.91 TB/s on a grid of
its 128 working CTAs, 3.88 on 256, 3.54 on the plan's bound of 392; PDL and where idle CTAs exit
made no difference). A Gluon kernel with the decode kernel's shape (128 threads, ~115 KB of
shared memory: two CTAs an SM, grid (KV heads, items)) records each CTA's SM and start / end
(globaltimer); shared memory: the largest power-of-two words w with 1.75 w words within
``--smem-kb`` (112: 64 + 32 + 16 KB); the first ``--work`` items spin for ``--iters`` dependent FMAs, the others exit.

``--modes``: ``positions``, the working CTAs are the grid's first; ``claim`` / ``spread``, every
CTA claims its unit as the decode kernel does on a graph's bound grid (``sm90_decode._claim_unit``,
first come first served / the even SM subset first), the working CTAs are those whose unit is
below the work's; the report counts them per block of 16 SM ids too (ids run GPC by GPC).

    python benchmarks/sched_probe.py --heads 8 --work 16 --items 16,32,33,49,64 [--json F]
    python benchmarks/sched_probe.py --work 12 --items 45 --modes positions,claim,spread
"""
import argparse
import json

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ioattn.decode.sm90_decode import _claim_unit, _now_ns, _smid
from ioattn.decode.triton_decode import CLAIM_WORDS


@gluon.jit
def _probe(OUT, n_work, iters, CLAIMS, n_sms, SMEM_WORDS: gl.constexpr,
           CLAIM: gl.constexpr = False, SPREAD: gl.constexpr = False):
    item = gl.program_id(1)
    cta = item * gl.num_programs(0) + gl.program_id(0)
    n_ctas = gl.num_programs(0) * gl.num_programs(1)
    unit = cta
    if CLAIM:
        unit = _claim_unit(CLAIMS, n_work * gl.num_programs(0), n_ctas, n_sms, SPREAD)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    lane = gl.arange(0, 128, layout=layout)
    smid = _smid()
    t0 = _now_ns()
    # the shared memory that holds the occupancy to two CTAs an SM, touched so it stays
    # (three buffers: a shared allocation's shape is a power of two)
    sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    buf = gl.allocate_shared_memory(gl.float32, [SMEM_WORDS], sl)
    buf2 = gl.allocate_shared_memory(gl.float32, [SMEM_WORDS // 2], sl)
    buf4 = gl.allocate_shared_memory(gl.float32, [SMEM_WORDS // 4], sl)
    x = lane.to(gl.float32)
    buf.slice(0, 128).store(x)
    buf2.slice(0, 128).store(x)
    buf4.slice(0, 128).store(x)
    if unit < n_work * gl.num_programs(0):
        for _ in range(iters):
            x = x * 1.0000001 + 1.0
    x = x + buf.slice(SMEM_WORDS - 128, 128).load(layout)
    x = x + buf2.slice(0, 128).load(layout) + buf4.slice(0, 128).load(layout)
    t1 = _now_ns()
    first = lane == 0
    base = OUT + cta.to(gl.int64) * 5
    gl.store(base + lane * 0, smid.to(gl.int64), mask=first)
    gl.store(base + 1 + lane * 0, t0, mask=first)
    gl.store(base + 2 + lane * 0, t1, mask=first)
    gl.store(base + 3 + lane * 0, x.to(gl.int64), mask=lane == 1)
    gl.store(base + 4 + lane * 0, unit.to(gl.int64), mask=first)


def probe(heads: int, work: int, items: int, iters: int, smem_kb: int, graph: bool,
          mode: str = "positions") -> dict:
    out = torch.full((items * heads, 5), -1, dtype=torch.int64, device="cuda")
    words = 1 << ((smem_kb * 256 * 4 // 7).bit_length() - 1)  # (words + words/2 + words/4)
    claims = torch.zeros(CLAIM_WORDS, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def launch():
        _probe[(heads, items)](out, work, iters, claims, sms, SMEM_WORDS=words,
                               CLAIM=mode != "positions", SPREAD=mode == "spread", num_warps=4)
    launch()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            launch()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    rows = out.cpu().tolist()
    t_min = min(r[1] for r in rows)
    real = [r for r in rows if 0 <= r[4] < work * heads]
    idle = [r for r in rows if not 0 <= r[4] < work * heads]
    assert sorted(r[4] for r in real) == list(range(work * heads)), "a unit ran twice or never"
    sm_ids = [r[0] for r in real]
    per_sm, per_block = {}, {}
    for s_ in sm_ids:
        per_sm[s_] = per_sm.get(s_, 0) + 1
        per_block[s_ // 16] = per_block.get(s_ // 16, 0) + 1
    return dict(heads=heads, work=work, items=items, grid_ctas=items * heads, graph=graph,
                mode=mode, working_per_16_sm_ids=[per_block.get(i, 0) for i in range(-(-sms // 16))],
                working_sms=len(per_sm), sms_with_two=sum(1 for v in per_sm.values() if v >= 2),
                working_start_us=[round((r[1] - t_min) / 1e3, 2) for r in real],
                working_end_us=[round((r[2] - t_min) / 1e3, 2) for r in real],
                working_sm=sm_ids,
                idle_end_us_max=max([round((r[2] - t_min) / 1e3, 2) for r in idle], default=None))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--work", type=int, default=16)
    ap.add_argument("--items", default="16,32,33,49,64")
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--smem-kb", type=int, default=112)
    ap.add_argument("--modes", default="positions")
    ap.add_argument("--json")
    a = ap.parse_args()
    results = []
    for mode in a.modes.split(","):
        for graph in (False, True):
            for items in [int(x) for x in a.items.split(",")]:
                r = probe(a.heads, a.work, items, a.iters, a.smem_kb, graph, mode)
                results.append(r)
                st, en = r["working_start_us"], r["working_end_us"]
                print(f"{mode} items {items:3d} grid {r['grid_ctas']:4d} graph {int(graph)}: "
                      f"working CTAs on {r['working_sms']} SMs ({r['sms_with_two']} with two), "
                      f"per 16 SM ids {r['working_per_16_sm_ids']}, start {min(st)}-{max(st)} us, "
                      f"end {min(en)}-{max(en)} us, idle CTAs done by {r['idle_end_us_max']} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), results=results), f)


if __name__ == "__main__":
    main()

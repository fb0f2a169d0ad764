"""The read ceiling of the sm90 decode kernel's request stream, without its math (issue 4's
64 x 4k cell: our kernel reads the same bytes as cuDNN's at 88-91% of DRAM peak against cuDNN's
91-94%, whatever the loader (TMA or cp.async), page size or layout; benchmarks/NOTES.md,
sessions 25-27). A Gluon kernel with the decode kernel's skeleton (grid (KV heads, requests),
one TMA producer warp filling a ring of STAGES stages of BLOCK_N keys of K and V, one consumer
warpgroup) whose consumer only waits for each stage and frees it, optionally after spinning
DELAY ns (the time the real consumer's QKᵀ, softmax and P·V hold a stage). It reads a
contiguous HND cache [b, h_k, ctx, d] (cuDNN's own K / V), so its rate is the ring's and the
grid's, not the page table's.

If the bare ring reads at cuDNN's rate, the consumer's time on each stage is the gap; if it
reads at ours, the ring / grid shape is, and the sweep shows which shape reads faster (session
28, on an H100: fewer tiles in flight an SM read faster, which ``sm90_decode.SHALLOW`` acts on).
Timed beside SDPA cuDNN and the planned decode under ``--ours`` settings of sm90_decode's
constants (each checked against cuDNN's output first), over a copy of the same K / V as one
page a request (HND, K and V of a request side by side) and as shuffled pages of ``--page``
keys (NHD), in one process: graph replays of ``--loop`` calls back to back (time per call),
median of ``--rounds``, every implementation twice in turn.

    python benchmarks/read_probe.py --cell 64x4096 --configs 3x64x2x0,3x64x2x400,2x64x1x0 \
        --ours 3x1x1,3x1x0 --json F
    (--configs: stages x keys a stage x CTAs an SM (1: shared memory padded) x spin ns
     [x keys a copy [x order: 0 rows in order, 1 an identity table, 2 a shuffled table,
     3 shuffled within each 2 MB]];
     --ours: STAGES x ROWS_AHEAD x SHALLOW [x MMA16 [x items a CTA [x EARLY]]])
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

import ioattn.flashinfer as fi
from ioattn.decode import sm90_decode as sd
from ioattn.decode.sm90_decode import _now_ns
from ioattn.dense.sm90_common import barriers, invalidate
from tune_decode import _replayed  # (run as a script: benchmarks/ is on sys.path)


@gluon.jit
def _produce(k_desc, v_desc, k_smem, v_smem, full, empty, row0, n_tiles, TABLE,
             STAGES: gl.constexpr, BLOCK_N: gl.constexpr, TABLED: gl.constexpr):
    BOX: gl.constexpr = k_desc.block_type.shape[0]  # keys a copy (a page's, as ours per page)
    NB: gl.constexpr = BLOCK_N // BOX
    for j in range(n_tiles):
        st = j % STAGES
        mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(full.index(st), 2 * NB * k_desc.block_type.nbytes)
        for i in gl.static_range(NB):
            row = row0 + j * BLOCK_N + i * BOX
            if TABLED:  # (a page table's entry for each copy: the box of rows it reads)
                row = gl.load(TABLE + row // BOX) * BOX
            tma.async_copy_global_to_shared(k_desc, [row, 0], full.index(st),
                                            k_smem.index(st).slice(i * BOX, BOX, dim=0))
            tma.async_copy_global_to_shared(v_desc, [row, 0], full.index(st),
                                            v_smem.index(st).slice(i * BOX, BOX, dim=0))


@gluon.jit
def _consume(OUT, k_smem, full, empty, n_tiles, delay_ns, cta, STAGES: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    acc = gl.zeros([32, 32], gl.float32, layout)
    for j in range(n_tiles):
        st = j % STAGES
        mbarrier.wait(full.index(st), (j // STAGES) & 1)
        # a read of the stage, so the wait is on data the consumer uses (as the real one's wgmma)
        acc += k_smem.index(st).slice(0, 32, dim=0).slice(0, 32, dim=1).load(layout).to(gl.float32)
        if delay_ns > 0:
            t0 = _now_ns()
            t = t0
            while t - t0 < delay_ns:
                t = _now_ns()
        gl.thread_barrier()
        mbarrier.arrive(empty.index(st), count=1)
    total = gl.sum(gl.sum(acc, axis=1), axis=0)
    gl.store(OUT + cta, total)


@gluon.jit
def _read_probe(k_desc, v_desc, OUT, TABLE, n_keys, delay_ns, STAGES: gl.constexpr,
                BLOCK_N: gl.constexpr, D: gl.constexpr, PAD_BYTES: gl.constexpr,
                TABLED: gl.constexpr):
    head = gl.program_id(0)
    req = gl.program_id(1)
    cta = req * gl.num_programs(0) + head
    row0 = cta * n_keys  # (the [b, h_k, ctx, d] cache as rows: one (request, head) a run)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    if PAD_BYTES > 0:  # (occupancy: one CTA an SM)
        pad_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        pad = gl.allocate_shared_memory(gl.int8, [PAD_BYTES], pad_layout)
        lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        lanes = gl.arange(0, 128, layout=lane_layout)
        pad.slice(PAD_BYTES - 128, 128).store(lanes.to(gl.int8))
        gl.store(OUT + gl.num_programs(0) * gl.num_programs(1) + cta + lanes * 0,
                 pad.slice(PAD_BYTES - 128, 128).load(lane_layout).to(gl.float32),
                 mask=lanes == 1)
    full = barriers(STAGES, 1)
    empty = barriers(STAGES, 1)
    fence_async_shared()
    n_tiles = n_keys // BLOCK_N
    gl.warp_specialize([
        (_consume, (OUT, k_smem, full, empty, n_tiles, delay_ns, cta, STAGES)),
        (_produce, (k_desc, v_desc, k_smem, v_smem, full, empty, row0, n_tiles, TABLE, STAGES,
                    BLOCK_N, TABLED)),
    ], [1], [24])
    invalidate(full, STAGES)
    invalidate(empty, STAGES)


def probe_fn(k: torch.Tensor, v: torch.Tensor, stages: int, block_n: int, per_sm: int,
             delay: int, box: int = 0, order: int = 0):
    """The bare ring over k / v; box: keys a TMA copy (0: the stage's block_n, one copy of K
    and one of V a stage; 16: four a 64-key stage, as ours issues over pages of 16); order:
    0 each CTA's rows in order, 1 each copy's box of rows read from a table (the identity: a
    page table's dependent load, the same rows), 2 from a shuffled table (every box of the
    cache read once, by a CTA that does not own it: shuffled pages' scattered reads), 3 shuffled
    within each 2 MB of the cache (scattered reads, TLB reach as in order)."""
    b, h_k, ctx, d = k.shape
    box = box or block_n
    if block_n % box or box % 8:
        raise SystemExit(f"keys a copy {box}: a multiple of 8 dividing {block_n}")
    layout = gl.NVMMASharedLayout.get_default_for([box, d], gl.bfloat16)
    kd = TensorDescriptor.from_tensor(k.view(-1, d), [box, d], layout)
    vd = TensorDescriptor.from_tensor(v.view(-1, d), [box, d], layout)
    out = torch.empty(2 * b * h_k, device=k.device, dtype=torch.float32)
    n_boxes = k.numel() // d // box
    if order < 2:
        table = torch.arange(n_boxes, device=k.device)
    elif order == 2:
        table = torch.randperm(n_boxes, device=k.device)
    else:  # 3: shuffled within each 2 MB (a GPU page's reach: TLB misses as in order)
        group = max(1, (2 << 20) // (box * d * k.element_size()))
        if n_boxes % group:
            raise SystemExit(f"order 3: {n_boxes} boxes are not whole 2 MB groups of {group}")
        table = (torch.argsort(torch.rand(n_boxes // group, group, device=k.device), dim=1)
                 + torch.arange(0, n_boxes, group, device=k.device)[:, None]).flatten()
    table = table.to(torch.int32)
    used = 2 * stages * block_n * d * k.element_size()
    short = 120 * 1024 - used  # (past half the SM's 228 KB: one CTA an SM)
    pad = 1 << (short - 1).bit_length() if per_sm == 1 and short > 0 else 0  # (a power of two)
    if used + pad > 227 * 1024:
        raise SystemExit(f"stages {stages} x {block_n} keys: {used} B, more than an SM holds")
    if per_sm == 2 and used > 110 * 1024:
        raise SystemExit(f"stages {stages} x {block_n} keys: {used} B, not two CTAs an SM")

    def fn():
        _read_probe[(h_k, b)](kd, vd, out, table, ctx, delay, STAGES=stages, BLOCK_N=block_n,
                              D=d, PAD_BYTES=pad, TABLED=order > 0, num_warps=4, maxnreg=128)
    return fn


def graph_time(fn, loop: int, rounds: int) -> list[float]:
    """ms per call: ``loop`` calls captured in one graph, replayed ``rounds`` times."""
    fn()
    replay = _replayed(fn, loop)
    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / loop)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", default="64x4096", help="batch x context")
    p.add_argument("--configs", default="3x64x2x0,2x64x2x0,3x64x1x0,4x64x1x0,2x64x1x0",
                   help="bare rings: stages x keys a stage x CTAs an SM x spin ns a stage "
                        "[x keys a TMA copy (0: the stage's) [x order: 0 in order, 1 through "
                        "an identity table, 2 a shuffled one, 3 shuffled within each 2 MB]]")
    p.add_argument("--ours", default="3x1x1,3x1x0,3x0x0,2x1x0,4x1x1",
                   help="the planned decode's settings, each as STAGES x ROWS_AHEAD x SHALLOW "
                        "[x MMA16 [x ITEMS [x EARLY]]] (sm90_decode's constants, set for its launch; "
                        "ITEMS > 0: the unsplit items run ITEMS a CTA through the balanced "
                        "form's columns, the ring running on), over the contiguous K / V "
                        "and over a paged cache of --page keys (NHD, shuffled pages); STAGES "
                        "4 takes more than half an SM's shared memory: one CTA an SM")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--loop", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    a = p.parse_args(argv)
    b, ctx = (int(x) for x in a.cell.split("x"))
    saved = sd.STAGES, sd.ROWS_AHEAD, sd.SHALLOW, sd.MMA16, sd.EARLY
    h, h_k, d, dt = 32, 8, 128, torch.bfloat16
    k = torch.randn(b, h_k, ctx, d, device="cuda", dtype=dt)
    v = torch.randn(b, h_k, ctx, d, device="cuda", dtype=dt)
    q = torch.randn(b, h, d, device="cuda", dtype=dt)
    nbytes = 2 * k.numel() * k.element_size()

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)

    def wrapper(layout, pages, indptr, indices, last, page_size, items=0):
        """The planned decode over the cache; items > 0: its (unsplit) items run through the
        balanced form's columns, ``items`` a CTA with the ring running on from one to the next
        (no CTA ends between them)."""
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), kv_layout=layout,
            use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty(b + 1, dtype=torch.int32,
                                                                    device="cuda"),
            paged_kv_indices_buffer=torch.empty(indices.numel(), dtype=torch.int32,
                                                device="cuda"),
            paged_kv_last_page_len_buffer=torch.empty(b, dtype=torch.int32, device="cuda"))
        w.plan(indptr, indices, last, h, h_k, d, page_size, q_data_type=dt)
        if items:
            if int(w._n_work.item()) != b:
                raise SystemExit(f"items a CTA: the plan split the requests ({w._n_work.item()} "
                                 f"items for {b})")
            w._columns = torch.arange(0, b + 1, items, dtype=torch.int32, device="cuda")
            if w._columns[-1].item() != b:
                raise SystemExit(f"items a CTA: {items} does not divide the batch {b}")
            w._balanced = True
        return lambda: w.run(q, pages)

    kv = torch.stack((k, v), dim=1)  # [b, 2, h_k, ctx, d]: request i's K and V as page i
    # the same K / V in pages of --page keys, NHD, in shuffled order (the acceptance cell's form)
    n_pages = b * ctx // a.page
    perm = torch.randperm(n_pages, device="cuda")
    paged = torch.empty(n_pages, 2, a.page, h_k, d, device="cuda", dtype=dt)
    paged[perm] = kv.permute(0, 3, 1, 2, 4).reshape(n_pages, a.page, 2, h_k, d).transpose(1, 2)
    made = {}

    def planned(kind, items):
        """The planned decode over the cache as one page a request (whole, HND) or as
        --page pages (paged), items a CTA (0: one a CTA, the plan's grid); made once."""
        if (kind, items) not in made:
            if kind == "whole":
                cache = ("HND", kv, torch.arange(b + 1, dtype=torch.int32),
                         torch.arange(b, dtype=torch.int32, device="cuda"),
                         torch.full((b,), ctx, dtype=torch.int32), ctx)
            else:
                cache = ("NHD", paged, torch.arange(0, n_pages + 1, ctx // a.page,
                                                    dtype=torch.int32),
                         perm.to(torch.int32), torch.full((b,), a.page, dtype=torch.int32),
                         a.page)
            made[kind, items] = wrapper(*cache, items)
        return made[kind, items]

    ref = cudnn()[:, :, 0].float()
    errs = {}  # each setting's max abs error against cuDNN, both layouts
    fns = [("cudnn", cudnn)]
    for o in a.ours.split(","):
        st, ahead, shallow, *more = (int(x) for x in o.split("x"))
        mma16 = more[0] if more else int(saved[3])
        items = more[1] if len(more) > 1 else 0
        early = more[2] if len(more) > 2 else int(saved[4])
        if items and shallow:  # (the balanced form keeps STAGES in flight, PREFETCH off)
            raise SystemExit(f"--ours {o}: items a CTA run the balanced form, which has no "
                             "SHALLOW; give SHALLOW 0 and STAGES the tiles in flight")

        def setting(fn, new=(st, bool(ahead), bool(shallow), bool(mma16), bool(early))):
            def run():
                sd.STAGES, sd.ROWS_AHEAD, sd.SHALLOW, sd.MMA16, sd.EARLY = new
                try:
                    return fn()
                finally:
                    sd.STAGES, sd.ROWS_AHEAD, sd.SHALLOW, sd.MMA16, sd.EARLY = saved
            return run
        tag = (f"s{st}_ahead{ahead}_shallow{shallow}" + (f"_mma16{mma16}" if more else "")
               + (f"_items{items}" if items else "") + (f"_early{early}" if len(more) > 2 else ""))
        for name, fn in ((f"ours_whole_{tag}", setting(planned("whole", items))),
                         (f"ours_page{a.page}_{tag}", setting(planned("paged", items)))):
            errs[name] = (fn().float() - ref).abs().max().item()
            if not errs[name] < 4e-3:  # (bf16 outputs of unit-scale attention: ~5e-4 apart)
                raise SystemExit(f"{name}: max abs error {errs[name]:.2e} against cuDNN")
            fns.append((name, fn))
    for c in a.configs.split(","):
        st, bn, per_sm, delay, *more = (int(x) for x in c.split("x"))
        fns.append((f"probe_s{st}_n{bn}_cta{per_sm}_d{delay}"
                    + (f"_box{more[0]}" if more else "")
                    + (f"_order{more[1]}" if len(more) > 1 else ""),
                    probe_fn(k, v, st, bn, per_sm, delay, *more)))
    results = []
    for name, fn in fns:  # (two passes, so each impl is timed twice apart: the card drifts)
        results.append(dict(name=name, ms=graph_time(fn, a.loop, a.rounds)))
    for name, fn in fns:
        results.append(dict(name=name + "#2", ms=graph_time(fn, a.loop, a.rounds)))
    for r in results:
        r["tb_s"] = nbytes / (statistics.median(r["ms"]) * 1e-3) / 1e12
        print(f"{r['name']:32s} {statistics.median(r['ms']) * 1e3:8.1f} us  {r['tb_s']:.3f} TB/s")
    err = max(errs.values(), default=0.0)
    print(f"ours vs cuDNN max abs error {err:.2e} (worst of {len(errs)} settings x layouts)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           date=datetime.date.today().isoformat(),
                           git_commit=os.environ.get("IOATTN_GIT_COMMIT", "unknown"),
                           triton=__import__("triton").__version__, cell=a.cell, loop=a.loop,
                           rounds=a.rounds, bytes=nbytes, max_abs_err=err, max_abs_err_by_setting=errs,
                           results=results), f,
                      indent=1)


if __name__ == "__main__":
    main()

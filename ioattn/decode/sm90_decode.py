"""Hopper (sm90) paged decode in Gluon, for the planned decode (``BatchDecodeWithPagedKVCacheWrapper``).

Why a second decode kernel: the portable one (``triton_decode._kvcache_attn_kernel``) computes each
K/V tile's addresses from a page-table load in the same iteration, and Triton's pipeliner then
keeps one K and one V buffer per program (benchmarks/NOTES.md, session 4): the loads in flight
come only from programs per SM, which few-request cells (1 x 32k: two per SM) cannot supply.
Here a 1-warp producer walks the page table ahead of the math and issues one TMA copy per page
run of each key tile into a ring of ``STAGES`` shared-memory stages, so every CTA keeps several
K/V tiles in flight whatever the page size (a multiple of 8 keys).

One CTA runs one work item of the plan (request, key range, partial slot) for one KV head: the
GQA group's query heads are the rows of a 64-row wgmma tile (rows past the group are zero and
never stored), S = Q·Kᵀ and O += P·V on the tensor cores, online softmax in registers (one
consumer warpgroup). Items of a split request write fp32 partials to their slots, merged by the
request's last item inside the kernel (MERGE) or by the portable combine kernel; the others write
out and the LSE directly, as the portable kernel does.

The cache is read through 2-D TMA views whose rows are key slots: NHD pages [pages, page_size,
H_kv, D] (a row holds every head; the head is a column offset) or HND [pages, H_kv, page_size, D]
(a row holds one head; the head is a row offset), interleaved K/V pages or separate pools.
Slots past a request's last key are masked; the producer zeroes them in the last V tile (stale
cache slots may hold NaN, and a masked P of 0 times NaN is NaN), or, in the balanced form (one
CTA looping over several items, ``BALANCED``), the consumer does.

fp8 caches (CONVERT, opt-in ``FP8``): the ring holds the fp8 tiles; the consumer converts each
stage to fp16 operand tiles in shared memory (zeroing V's slots past the request's keys there
instead of the producer) and frees the stage before its wgmmas.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ioattn.dense.sm90_common import (OPERAND_DTYPES, barriers, grid_dependency_wait,
                                      invalidate, launch_dependents, score_scales, shared_layout,
                                      softcap_tanh, wgmma_a_operand, wgmma_acc_layout,
                                      zero_last_key_tile, zero_tail_rows)
from ioattn.dispatch import sm_count
from ioattn.decode.triton_decode import CLAIM_WORDS
from ioattn.launch import Desc, launcher, repeat

ROWS = gl.constexpr(64)  # wgmma's M: the GQA group's query heads, zero-padded
BLOCK_N = 64  # keys per tile
# K/V tiles in flight per CTA (32 KB each at d=128): 3 stages take 112 KB of shared memory
# (114,908 B with Q and barriers: two CTAs and their 1 KB reservations fit the SM's 228 KB) and
# 128 registers a thread at launch (MAXNREG; the consumer warpgroup grows to 232 through
# setmaxnreg, spill-free), so two CTAs fit on an SM: six tiles in flight, or four where the
# work's CTAs share SMs (``SHALLOW``)
STAGES = 3
# fp8 caches (``FP8``): the ring holds fp8 tiles (16 KB a stage at d=128) and the consumer
# converts each into two operand tiles of fp16 (32 KB): 4 stages keep the CTA at 114,892 B,
# two a SM, 128 KB of K/V in flight per SM
STAGES_FP8 = 4
# fp8 caches (FlashInfer's kv_data_type e4m3 / e5m2) on this kernel, their tiles converted in
# shared memory (``_convert_tile``): on by default since it measured 1.24-1.26x the portable
# kernel on the H200 (2.29 / 2.25 against 1.84 / 1.80 TB/s of fp8 bytes at 64 x 4k / 128 x 2k,
# 1.67 against 1.33 at 16 x 8k; results/decode_fp8_sm90{1,0}_5952fd0_*.json);
# IOATTN_SM90_DECODE_FP8=0 sends them to the portable kernel
FP8 = os.environ.get("IOATTN_SM90_DECODE_FP8", "1").lower() not in ("0", "false", "off")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MAXNREG = 128
# d=256: the 64 x 256 fp32 O tile takes 128 of the consumer's registers and its wgmma more
# than 128 to issue, so the kernel compiles for MAXNREG_D256 a thread (ptxas: "insufficient
# registers (128) ... 158 or higher"); 3 stages of 64 keys (64 KB each) and Q take 229,612 B of
# shared memory: one CTA an SM, 192 KB in flight (128 KB where its units outnumber the SMs,
# ``SHALLOW``). sm90 compile: spill-free (merge, GQA 2, balanced page 64). On by default since
# it measured 1.8-3.5x the portable kernel and 1.17-1.27x cuDNN on the H200 (eager; GQA 16 / 8
# heads, page 16: 64 x 4k 4.32 TB/s against 1.94 and cuDNN's 3.39; 16 x 8k 4.17 / 1.19 / 3.34;
# 1 x 32k 3.05 / 1.70 / 2.60; 128 x 2k 4.26 / 2.27 / 3.41; results/decode_d256_sm90{1,0}_4528809_*
# .json) with its GPU tests passed; IOATTN_SM90_DECODE_D256=0 sends d=256 to the portable kernel
D256 = os.environ.get("IOATTN_SM90_DECODE_D256", "1").lower() not in ("0", "false", "off")
MAXNREG_D256 = 232
SUPPORTED_HEAD_DIMS = (64, 128, 256) if D256 else (64, 128)
# programmatic dependent launch (default, as FlashInfer's on Hopper; IOATTN_SM90_DECODE_PDL=0
# turns it off): the kernel is launched with launch_pdl, so its CTAs may start while the
# stream's previous kernel finishes (its launch and CTA setup off the critical path: a few us of
# a 1 x 32k step's ~40), and
# waits in ``grid_dependency_wait`` before touching memory the previous kernel may write (before
# it, only the plan's buffers are read: N_WORK, the L2 prefetches' aim, with EARLY the item); it
# then lets the next PDL-launched kernel (the next layer's decode) start the same way. Under
# CUDA graph capture the launch attribute becomes a programmatic edge. Expected: the graph-replayed 1 x 32k cell toward the
# kernel's own rate (3.76 TB/s in the kernel against 3.39 replayed back to back)
# Timed (session 16, results/decode_pdl{00,01,10,11}_b1d4228_*): replayed back to back, +1% in
# each pair (1 x 32k 3.45 / 3.41 against 3.41 / 3.37 TB/s, heads-first off / on; 64 x 4k
# 4.28 / 4.33 against 4.24 / 4.32); eager calls level
PDL = os.environ.get("IOATTN_SM90_DECODE_PDL", "1").lower() in ("1", "true", "on")
# the grid's axes as (KV heads, items) (default; IOATTN_SM90_DECODE_HEADS_FIRST=0 the old
# (items, KV heads)): one item's KV heads run side by side and read each key slot's row (NHD:
# all heads' slices) together, where (items, KV heads) runs half of them a wave later at
# 64 x 4k. Timed (session 16, results/decode_pdl{00,01,10,11}_b1d4228_*): 64 x 4k 4.13 / 4.15
# TB/s against 4.11 / 4.10 eager (PDL off / on), 4.32 / 4.33 against 4.24 / 4.28 replayed back
# to back; 1 x 32k replayed 3.37 / 3.41 against 3.41 / 3.45 (within a run's spread)
HEADS_FIRST = os.environ.get("IOATTN_SM90_DECODE_HEADS_FIRST", "1").lower() in ("1", "true", "on")
PRODUCER_REGS = 24
# (with PDL) before its wait for the previous kernel, each CTA aims L2 prefetches
# (cp.async.bulk.prefetch.L2) at its item's first STAGES key tiles (K and V rows of its KV head),
# so they stream from memory while the previous kernel's last CTAs (a split request's merge, the
# stragglers) finish, instead of after. Safe whatever that kernel writes: the plan buffers and
# page table are read there only to aim the prefetches (the item is read again after the wait),
# and L2 stays coherent with later writes. Expected: the graph-replayed 1 x 32k cell toward the
# kernel's own rate (3.41-3.45 TB/s replayed against 3.76 in the kernel). On by default: the
# replayed 1 x 32k cell 3.41 -> 3.54 TB/s, 64 x 4k unchanged (4.12 / 4.13), on / off in one run
# (results/decode_prefetch{1,0}_ebb00c7_*.json). IOATTN_SM90_DECODE_PREFETCH=0 turns it off
PREFETCH = os.environ.get("IOATTN_SM90_DECODE_PREFETCH", "1").lower() in ("1", "true", "on")
# A launch on a grid larger than the plan's work (a CUDA graph's bound, fixed at capture) has
# its CTAs claim (item, KV head) units SM by SM instead of taking the unit of their grid
# position, when the work fits one unit per SM. The block scheduler fills the slots of a grid
# of a full wave or more (two CTAs an SM: 264 on the H200) GPC by GPC, so the grid's first
# units double up on some SMs while others get none: a probe kernel's first 128 of 264-512
# CTAs ran on 120 SMs, 8 with two, where 128 or 256 CTAs put them on 128
# (benchmarks/sched_probe.py; results/tune/sched_probe_9af71c4_*), and the replayed 16 x 8k
# decode ran 3.54 TB/s on the bound's 392 CTAs against 3.91 on its 128, 12 x 8k 2.84 / 3.39
# (results/tune/tune_sm90_decode_grid_9af71c4_*; PDL off or the idle CTAs exiting before
# PDL's wait changed nothing: tune_decode_idle_*). A claiming CTA counts itself on its SM;
# the first on each SM takes the next unit at once, the others wait (at most CLAIM_WAIT_NS)
# until the units are all taken, then take one (past the work: they exit).
# IOATTN_SM90_DECODE_CLAIM=0 keeps the grid positions
CLAIM = os.environ.get("IOATTN_SM90_DECODE_CLAIM", "1").lower() in ("1", "true", "on")
CLAIM_WAIT_NS = gl.constexpr(2000)
# only the first CTAs on an even subset of SM ids, one SM per unit, take theirs at once; the
# others wait as above. SM ids run GPC by GPC, so the units spread over the GPCs as the block
# scheduler spreads a grid of exactly the units, where first come, first served crowded them:
# 12 x 8k's 96 units ran 3.08-3.13 TB/s claimed FCFS against 3.40 on a grid of its own 96 CTAs
# (results/tune/tune_decode_claim_extra_9472184_*.log). Spread / FCFS in one call
# (results/tune/tune_decode_claim11{1,0}_92c65de_*): 12 x 8k on the bound 3.37 / 3.13 (own grid
# 3.39 / 3.38), 16 x 8k 3.81 / 3.81, 8 x 8k (no claims) 3.09 / 3.08; the probe's 96 claimed units
# per block of 16 SM ids [11, 12, 11, 12, 12, 11, 12, 12, 3] against FCFS's
# [11, 10, 10, 14, 10, 11, 14, 12, 4] (sched_probe_claims_92c65de_*). On by default;
# IOATTN_SM90_DECODE_CLAIM_SPREAD=0: first come, first served
CLAIM_SPREAD = os.environ.get("IOATTN_SM90_DECODE_CLAIM_SPREAD", "1").lower() in ("1", "true", "on")
# (opt-in until timed, IOATTN_SM90_DECODE_LOADER=cpasync) the producer fills the ring with
# cp.async (16 bytes a lane, L1 bypassed, each lane's copies completing the stage's barrier
# through cp.async.mbarrier.arrive) instead of TMA: cuDNN's decode kernel (sm80, cp.async) read
# 64 x 4k at 93.2-94.3% of DRAM peak where ours read the same bytes in the same order at
# 91.4-91.9% (results/tune/ncu_decode_whole_64x4096x16_f341af4_*): hypothesis, TMA's request
# stream. Masked copies zero-fill the slots past the request's keys (no zeroing pass); bf16 /
# fp16 caches, one item a CTA (fp8 and the balanced form keep TMA). CP_WARPS producer warps.
# Timed (results/tune/tune_decode_loader_{tma,cpasync}_0_{1,2}_1b00ff3_*, graph replays,
# interleaved): 64 x 4k 4.19 / 4.19 against TMA's 4.19 / 4.18 (the hypothesis is refuted: the
# loader is not the gap), 16 x 8k 3.29 against 3.84-3.86 (one CTA an SM there: one producer
# warpgroup's issue rate), 128 x 2k 4.04-4.05 against 4.15-4.16. TMA stays the default
_loader = os.environ.get("IOATTN_SM90_DECODE_LOADER", "tma").lower()
if _loader not in ("tma", "cpasync"):
    raise ValueError(f"IOATTN_SM90_DECODE_LOADER={_loader!r}: use tma or cpasync")
CP_ASYNC = _loader == "cpasync"
CP_WARPS = 4
CP_REGS = 40
# the TMA producer loads each key tile's page-table entries a tile ahead, before it waits for
# the tile's stage, instead of after (then each refill of a stage waits a load's latency, the
# entry's L2 hit or miss, before its copies go out; it replaces session 27's page-table line
# prefetch to L2 / L1, which timed level: tune_decode_loader_tma_{0,l2}_*_1b00ff3_*). Measured
# on an H100 with a 2-stage ring, graph replays of 64 x 4k page 16: 3.03 TB/s against 3.00-3.01
# loading after the wait; with three in flight 0.3-0.4% behind (2.98-3.00 against 2.99-3.01)
# (benchmarks/read_probe.py, results/tune/read_probe_{ahead,shallow}_e965def_nvidia-h100_*).
# IOATTN_SM90_DECODE_ROWS_AHEAD=0 loads them after the wait
ROWS_AHEAD = os.environ.get("IOATTN_SM90_DECODE_ROWS_AHEAD", "1").lower() in ("1", "true", "on")
# (bf16 / fp16 caches, one item a CTA) two key tiles in flight a CTA instead of STAGES when the
# launch's (item, KV head) units outnumber the SMs (N_WORK, read in the kernel: graph-safe), so
# that every SM has work and (d=128) two CTAs share most SMs: the ring keeps its STAGES stages
# (occupancy unchanged), the producer waits for the tile two back to be freed before it loads
# the next. Found with benchmarks/read_probe.py on an H100: a bare TMA ring of 64-key K+V tiles
# (no page table, no math) read 64 x 4k at 3.00 TB/s with 3 stages x 2 CTAs an SM (192 KB in
# flight an SM), 3.08-3.09 with 2 x 2, 3.09-3.10 with 3 x 1, 3.12-3.13 with 2 x 1, cuDNN 3.05:
# the fewer bytes in flight, the faster, down to 64 KB an SM (a spin of up to 600 ns a stage in
# the consumer changed nothing) (results/tune/read_probe_{bare,ahead}_e965def_*). The planned
# decode in one run (read_probe_shallow_e965def_*): 64 x 4k over a copy of cuDNN's K/V as one
# page a request 3.05 TB/s (2.95 without), page 16 3.01-3.02 (2.99), cuDNN 3.05. Graph
# replays on / off (tune_decode_shallow{1,0}_*_e965def_*) moved +0.3-1.3% in every cell,
# 16 x 8k and 12 x 8k (never engaged there) as much: run-order drift, not evidence. Two stages
# for every launch lost 12 x 8k (96 CTAs: SMs idle; 2.51 against 2.61,
# tune_decode_stages{2,3}_*_e965def_*), hence the rule. Not yet timed on the H200.
# IOATTN_SM90_DECODE_SHALLOW=0 keeps STAGES in flight
SHALLOW = os.environ.get("IOATTN_SM90_DECODE_SHALLOW", "1").lower() in ("1", "true", "on")
# (GQA groups of at most 16 query heads) the consumer on mma.sync (m16n8k16, ``_consumer_mma16``)
# instead of a 64-row wgmma tile: the group padded to 16 rows, not 64, so a 4-head group's
# tensor work and softmax shrink 4x (wgmma's M is 64: at 32 / 8 heads, 60 of its 64 rows are
# padding). Each of the four consumer warps takes 16 keys of every tile with its own online
# softmax (no cross-warp traffic a tile); their states merge once an item. Hypothesis: the
# consumer's time on each stage is part of the last 2.8% between the bare ring and ours at
# 64 x 4k on the H200 (read_probe_shallow_6a6de0a_*). Refuted on the H100: 64 x 4k over
# cuDNN's K/V 3.06 TB/s on / 3.03-3.06 off, page 16 3.01-3.03 / 3.02 (cuDNN 3.05), graph
# replays of five cells level (results/tune/{read_probe,tune_decode}_mma16*_d3f5a4c_*); GPU
# tests 141 passed on and off. Untimed on the H200, so opt-in: IOATTN_SM90_DECODE_MMA16=1
MMA16 = os.environ.get("IOATTN_SM90_DECODE_MMA16", "0").lower() in ("1", "true", "on")
MMA16_ROWS = gl.constexpr(16)
# (one item a CTA) the CTA reads its item (the plan's WORK row, then its request's SEQ entries)
# before PDL's wait, not after: the decode wrapper's plan() writes those buffers (and N_WORK)
# by copies from the host, after the zero fill that allocates them, so the kernel launched
# just before this one (the only one PDL overlaps it with) cannot be writing them (the page
# table and Q may be: they are read after the wait). And only the first 2 * SMs CTAs (in
# launch order) aim L2 prefetches (``PREFETCH``): a later CTA starts when one before it ends,
# with no kernel left to wait for, and its prefetches were one more dependent load (the page
# table) before its first copy. (2 * SMs approximates the first wave: d=64 fits more CTAs an
# SM, and on a graph's bound grid with the items axis second, CTAs past the plan's items
# count too; both only cost prefetches, never correctness.)
# Hypothesis: the fixed time of a CTA's start, its chain of dependent loads (N_WORK, WORK,
# SEQ, the page table for the prefetches, then the page table again and the first copy) while
# its SM's other CTA starts too (CTAs of equal work end together), is part of 64 x 4k's gap
# (2.8% between the bare ring and ours on the H200); this takes about half of that chain off.
# Timed on an H100 (results/tune/{read_probe_early,tune_decode_early*}_a1ee344_nvidia-h100_*,
# read_probe_early_rev_25b0bb6_*): 64 x 4k page 16 3.028 / 3.029 TB/s against 3.020 / 3.021
# off, 3.016 / 3.019 against 3.013 / 3.015 in the reversed order (cuDNN 3.05-3.06); graph
# replays of 64 x 4k 2.91 / 2.91 against 2.89 / 2.90, four other cells level: +0.1-0.7%, every
# pairing the same sign. Not yet timed on the H200. On by default; IOATTN_SM90_DECODE_EARLY=0
# reads the item after the wait, every CTA prefetching
EARLY = os.environ.get("IOATTN_SM90_DECODE_EARLY", "1").lower() in ("1", "true", "on")
# the claim counters: next unit, claims made, then one arrival count per SM (ids folded into
# CLAIM_SMS slots; ``triton_decode.CLAIM_WORDS`` words, which the wrapper allocates without
# loading Gluon)
CLAIM_SMS = gl.constexpr(CLAIM_WORDS - 2)


@gluon.jit
def _slot_row(INDICES, bt_row, n_pages_b, key, page_rows, row_off, PAGE: gl.constexpr,
              mask=True):
    """Row (int64) of the cache views holding a request's key slot (scalar or tensor): its page
    from the request's page-table row, row_off for the head (HND), key % PAGE within the page.
    Entries past the request's pages (or masked off) read as page 0."""
    idx = key // PAGE
    page = gl.load(INDICES + bt_row + idx, mask=mask & (idx < n_pages_b), other=0)
    return page.to(gl.int64) * page_rows + row_off + key % PAGE


@gluon.jit
def _decode_producer(k_desc, v_desc, k_smem, v_smem, full, empty, v_fixed, INDICES, bt_row,
                     n_pages_b, start, n_tiles, n_keys, row_off, page_rows, col,
                     PAGE: gl.constexpr, STAGES_: gl.constexpr, CONVERT: gl.constexpr, it0=0,
                     SELF_ZERO: gl.constexpr = False, ROWS_AHEAD_: gl.constexpr = False,
                     depth=0):
    """TMA loads of the item's key tiles [start + j * BLOCK_N, ...) into the ring from ring
    position it0: per tile one copy per page run (``PAGE`` keys, or the whole tile when pages
    are larger), at row page * page_rows + row_off (the head's, HND) + key % PAGE of the views.
    Page-table entries past the request's pages read as page 0 (those keys are masked; their V
    rows zeroed, here or, SELF_ZERO or CONVERT, by the consumer). ROWS_AHEAD_: each tile's
    page-table entries loaded a tile ahead (``ROWS_AHEAD``). depth in 1 .. STAGES_ - 1: at most
    that many tiles in flight or held by the consumer at once (``SHALLOW``); the stages still
    rotate."""
    BLOCK_N_: gl.constexpr = k_smem.shape[1]
    BOX: gl.constexpr = k_desc.block_type.shape[0]
    NB: gl.constexpr = BLOCK_N_ // BOX  # TMA copies a tile, of K and of V
    if ROWS_AHEAD_:
        # each tile's page-table entries loaded a tile ahead, before the wait for its stage,
        # so the copies go out as soon as the stage is free (``ROWS_AHEAD``)
        box_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        boxes = gl.arange(0, NB, layout=box_layout)
        nxt = _slot_row(INDICES, bt_row, n_pages_b, start + boxes * BOX, page_rows, row_off,
                        PAGE, n_tiles > 0).to(gl.int32)
    for j in range(n_tiles):
        st = (it0 + j) % STAGES_
        if ROWS_AHEAD_:
            cur = nxt
            nxt = _slot_row(INDICES, bt_row, n_pages_b, start + (j + 1) * BLOCK_N_ + boxes * BOX,
                            page_rows, row_off, PAGE, j + 1 < n_tiles).to(gl.int32)
        if (depth > 0) & (depth < STAGES_) & (j >= depth):
            # the tile depth back freed first (its stage's phase cannot have moved on since:
            # the stage's next tile is loaded after this one)
            back = it0 + j - depth
            mbarrier.wait(empty.index(back % STAGES_), (back // STAGES_) & 1)
        mbarrier.wait(empty.index(st), (((it0 + j) // STAGES_) & 1) ^ 1)
        mbarrier.expect(full.index(st), 2 * NB * k_desc.block_type.nbytes)
        for i in gl.static_range(NB):
            if ROWS_AHEAD_:
                row = gl.sum(gl.where(boxes == i, cur, 0), axis=0)
            else:
                row = _slot_row(INDICES, bt_row, n_pages_b, start + j * BLOCK_N_ + i * BOX,
                                page_rows, row_off, PAGE).to(gl.int32)
            tma.async_copy_global_to_shared(k_desc, [row, col], full.index(st),
                                            k_smem.index(st).slice(i * BOX, BOX, dim=0))
            tma.async_copy_global_to_shared(v_desc, [row, col], full.index(st),
                                            v_smem.index(st).slice(i * BOX, BOX, dim=0))
    # the last tile's slots past the request's keys: zero their V rows before P·V reads them
    # (CONVERT: the consumer zeroes them as it converts the tile)
    if not CONVERT and not SELF_ZERO:
        zero_last_key_tile(full, v_fixed, v_smem, v_smem, n_tiles, n_keys, STAGES_, False)


@gluon.jit
def _decode_producer_cp(K_RAW, V_RAW, k_row_stride, v_row_stride, k_smem, v_smem, full, empty,
                        INDICES, bt_row, n_pages_b, start, n_tiles, n_keys, row_off, page_rows,
                        col, PAGE: gl.constexpr, STAGES_: gl.constexpr, HEAD_D: gl.constexpr):
    """(``CP_ASYNC``) The item's key tiles into the ring by cp.async: each lane copies 16-byte
    pieces of key-slot rows (CHUNK rows a step), masked past the item's n_keys keys (zero-
    filled: those V rows must be zero for P·V) and past the request's pages, then arrives on
    the stage's barrier when its own copies land (the barrier counts every producer lane)."""
    BLOCK_N_: gl.constexpr = k_smem.shape[1]
    LANES_C: gl.constexpr = HEAD_D // 8  # 16-byte pieces a row
    W: gl.constexpr = gl.num_warps()
    CHUNK: gl.constexpr = 8 * W  # rows a step (whole 8-row swizzle periods of the tile)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES_C, LANES_C], [W, 1], [1, 0])
    rows_c = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
    for j in range(n_tiles):
        st = j % STAGES_
        mbarrier.wait(empty.index(st), ((j // STAGES_) & 1) ^ 1)
        for c in gl.static_range(BLOCK_N_ // CHUNK):
            key = j * BLOCK_N_ + c * CHUNK + rows_c  # (from the item's first tile's key)
            ok = key < n_keys
            row = _slot_row(INDICES, bt_row, n_pages_b, start + key, page_rows, row_off, PAGE,
                            ok)
            k_ptr = K_RAW + (row * k_row_stride + col)[:, None] + cols[None, :]
            v_ptr = V_RAW + (row * v_row_stride + col)[:, None] + cols[None, :]
            async_copy.async_copy_global_to_shared(k_smem.index(st).slice(c * CHUNK, CHUNK, dim=0),
                                                   k_ptr, mask=ok[:, None], cache_modifier=".cg")
            async_copy.async_copy_global_to_shared(v_smem.index(st).slice(c * CHUNK, CHUNK, dim=0),
                                                   v_ptr, mask=ok[:, None], cache_modifier=".cg")
        async_copy.mbarrier_arrive(full.index(st), increment_count=False)


@gluon.jit
def _decode_producer_one(k_desc, v_desc, k_smem, v_smem, full, empty, v_fixed, INDICES, bt_row,
                         n_pages_b, start, n_tiles, n_keys, row_off, page_rows, col, K_RAW,
                         V_RAW, k_row_stride, v_row_stride, PAGE: gl.constexpr,
                         STAGES_: gl.constexpr, HEAD_D: gl.constexpr, CONVERT: gl.constexpr,
                         CP_ASYNC_: gl.constexpr, ROWS_AHEAD_: gl.constexpr = False,
                         depth=0):
    """The producer of one item a CTA: by cp.async (CP_ASYNC_) or TMA."""
    if CP_ASYNC_:
        _decode_producer_cp(K_RAW, V_RAW, k_row_stride, v_row_stride, k_smem, v_smem, full,
                            empty, INDICES, bt_row, n_pages_b, start, n_tiles, n_keys, row_off,
                            page_rows, col, PAGE, STAGES_, HEAD_D)
    else:
        _decode_producer(k_desc, v_desc, k_smem, v_smem, full, empty, v_fixed, INDICES, bt_row,
                         n_pages_b, start, n_tiles, n_keys, row_off, page_rows, col, PAGE,
                         STAGES_, CONVERT, 0, False, ROWS_AHEAD_, depth)


@gluon.jit
def _convert_tile(src, dst, n_valid):
    """dst = src in dst's dtype (a [BLOCK_N, d] fp8 tile to fp16), rows >= n_valid zeroed:
    one consumer warpgroup, 16 values a thread a row piece (16-byte shared loads)."""
    ROWS_: gl.constexpr = src.shape[0]
    COLS: gl.constexpr = src.shape[1]
    LANES_C: gl.constexpr = COLS // 16
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // LANES_C, LANES_C], [4, 1], [1, 0])
    x = src.load(layout).to(dst.dtype)
    if n_valid < ROWS_:
        rows = gl.arange(0, ROWS_, layout=gl.SliceLayout(1, layout))
        x = gl.where((rows < n_valid)[:, None], x, gl.zeros_like(x))
    dst.store(x)


@gluon.jit
def _consumer_mma16(Q, O, LSE, O_PART, LSE_PART, q_smem, k_smem, v_smem, kc_smem, vc_smem,
                    full, empty, v_fixed, q_row, stride_qs, stride_qh, stride_os, stride_oh, h0,
                    group, n_heads, part, start, lo, hi, n_tiles, qk_scale_log2, softcap_scale,
                    COUNT, SLOT_START, off_b, HEAD_D: gl.constexpr, STAGES_: gl.constexpr,
                    LSE_BASE2: gl.constexpr, MERGE: gl.constexpr, GROUP_P2: gl.constexpr,
                    MERGE_SLOTS: gl.constexpr, CONVERT: gl.constexpr, it0=0,
                    SELF_ZERO: gl.constexpr = False, CP_ASYNC_: gl.constexpr = False):
    """(``MMA16``) ``_decode_consumer`` on mma.sync m16n8k16 for a GQA group of at most 16
    heads: the group's heads are the 16 rows of every warp's Q fragment (loaded once an item),
    warp w takes keys [16 w, 16 w + 16) of each tile (S = Q·Kᵀ, its own online softmax, O += P·V
    with P straight from S's registers), and the four warps' (m, l, O) merge once, through
    Q's shared buffer, at the end. Operands are read from the ring by ldmatrix (the generic
    proxy: no fence after TMA's completion or the producer's zeroing; our own zeroing is fenced,
    as TMA rewrites the stage later)."""
    BLOCK_N_: gl.constexpr = k_smem.shape[1]
    W: gl.constexpr = gl.num_warps()
    R: gl.constexpr = MMA16_ROWS
    KW: gl.constexpr = BLOCK_N_ // W  # keys a warp, of each tile (16: one k-step of P·V)
    HALF: gl.constexpr = HEAD_D // 2
    dtype: gl.constexpr = q_smem.dtype
    gl.static_assert(W * R == q_smem.shape[0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1],
                                                  instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    row3: gl.constexpr = gl.SliceLayout(2, mma)  # [W, R]: a warp's rows

    # Q: rows R w + r hold query head h0 + r (r < group) for every warp w
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    rq = gl.arange(0, W * R, layout=gl.SliceLayout(1, ld))
    cq = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ld))
    q_tile, q_exp = _load_q(Q, q_row, stride_qs, stride_qh, h0 + rq % R, rq % R < group, cq,
                            CONVERT)
    if CONVERT:  # (q scaled by 2^-q_exp: the raw scores, or softcap's tanh argument, undo it)
        if softcap_scale is None:
            qk_scale_log2 = qk_scale_log2 * gl.exp2(q_exp)
        else:
            softcap_scale = softcap_scale * gl.exp2(q_exp)
    q_smem.store(q_tile.to(dtype))
    gl.thread_barrier()
    q3 = q_smem.reshape([W, R, HEAD_D]).load(a_l)

    m_i = gl.full([W, R], float("-inf"), gl.float32, layout=row3)
    l_i = gl.full([W, R], 0.0, gl.float32, layout=row3)
    acc = gl.zeros([W, R, HEAD_D], gl.float32, layout=mma)
    s_zero = gl.zeros([W, R, KW], gl.float32, layout=mma)
    wk = gl.arange(0, W, layout=gl.SliceLayout(1, row3))
    ik = gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    koff = wk[:, None, None] * KW + ik[None, None, :]  # [W, 1, KW]: a warp's keys of a tile
    for j in range(n_tiles):
        st = (it0 + j) % STAGES_
        mbarrier.wait(full.index(st), ((it0 + j) // STAGES_) & 1)
        key0 = start + j * BLOCK_N_
        if CONVERT:
            # an fp8 cache: the stage's K and V converted to fp16 in the operand buffers (V's
            # slots past the request's keys zeroed on the way); the stage is then free
            _convert_tile(k_smem.index(st), kc_smem, BLOCK_N_)
            _convert_tile(v_smem.index(st), vc_smem, hi - key0)
            gl.thread_barrier()
            mbarrier.arrive(empty.index(st), count=1)
            k_op = kc_smem
            v_op = vc_smem
        else:
            k_op = k_smem.index(st)
            v_op = v_smem.index(st)
        k3 = k_op.reshape([W, KW, HEAD_D]).permute((0, 2, 1)).load(b_l)
        s = softcap_tanh(mma_v2(q3, k3, s_zero), softcap_scale)
        if (key0 < lo) | (key0 + BLOCK_N_ > hi):
            keys = key0 + koff
            s = gl.where((keys >= lo) & (keys < hi), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=2) * qk_scale_log2)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale_log2 - m_use[:, :, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, axis=2)
        m_i = m_new
        acc = acc * alpha[:, :, None]
        if not CONVERT and not CP_ASYNC_:
            if j == n_tiles - 1:
                if key0 + BLOCK_N_ > hi:  # V rows past the request's keys: zeroed
                    if SELF_ZERO:  # (in place, by the warpgroup, before it reads them)
                        zero_tail_rows(v_smem.index(st), hi - key0)
                        fence_async_shared()  # (the producer's TMA rewrites the stage later)
                        gl.thread_barrier()
                    else:  # (by the producer)
                        mbarrier.wait(v_fixed, 0)
        v3 = v_op.reshape([W, KW, HEAD_D]).load(b_l)
        acc = mma_v2(gl.convert_layout(p.to(dtype), a_l), v3, acc)
        gl.thread_barrier()  # every warp's reads of the stage (or operand buffers) done
        if not CONVERT:
            mbarrier.arrive(empty.index(st), count=1)

    # the warps' states merged through Q's buffer (Q is in registers): m and l, then O's
    # partials half the columns at a time ([W, R, D / 2] fp32), each read back with every
    # thread holding all W warps' values of its elements (a reduction without the compiler's
    # scratch, which would cost the second CTA an SM)
    flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    flat3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    buf_ml = q_smem._reinterpret(gl.float32, [2 * W, R], flat2)
    buf_o = q_smem._reinterpret(gl.float32, [W, R, HALF], flat3)
    red: gl.constexpr = gl.BlockedLayout([W, 1, 4], [1, 2, 16], [1, W, 1], [2, 1, 0])
    ml: gl.constexpr = gl.SliceLayout(2, red)  # [W, R]
    buf_ml.slice(0, W, dim=0).store(m_i)
    buf_ml.slice(W, W, dim=0).store(l_i)
    gl.thread_barrier()
    m_w = buf_ml.slice(0, W, dim=0).load(ml)
    l_w = buf_ml.slice(W, W, dim=0).load(ml)
    gl.thread_barrier()
    m = gl.max(m_w, axis=0)
    m_use = gl.where(m == float("-inf"), 0.0, m)
    sc = gl.exp2(m_w - m_use[None, :])
    l_t = gl.sum(l_w * sc, axis=0)
    lo_h, hi_h = gl.split(gl.permute(gl.reshape(acc, [W, R, 2, HALF]), (0, 1, 3, 2)))
    buf_o.store(lo_h)
    gl.thread_barrier()
    o_lo = gl.sum(buf_o.load(red) * sc[:, :, None], axis=0)
    gl.thread_barrier()
    buf_o.store(hi_h)
    gl.thread_barrier()
    o_hi = gl.sum(buf_o.load(red) * sc[:, :, None], axis=0)

    o2: gl.constexpr = gl.SliceLayout(0, red)  # [R, HALF]
    row_o: gl.constexpr = gl.SliceLayout(1, o2)
    l_o = gl.convert_layout(l_t, row_o)
    empty_row = l_o == 0.0
    l_safe = gl.where(empty_row, 1.0, l_o)
    lse = gl.where(empty_row, float("-inf"), gl.convert_layout(m_use, row_o) + gl.log2(l_safe))
    if not LSE_BASE2:
        lse = lse * 0.6931471805599453
    inv = (1.0 / l_safe)[:, None]
    rows_o = gl.arange(0, R, layout=row_o)
    cols_o = gl.arange(0, HALF, layout=gl.SliceLayout(0, o2))
    live = rows_o < group
    heads_o = (h0 + rows_o).to(gl.int64)
    if part >= 0:
        _store_part(O_PART, LSE_PART, o_lo * inv, lse, heads_o, cols_o, live, heads_o, live,
                    part, n_heads, HEAD_D, True)
        _store_part(O_PART, LSE_PART, o_hi * inv, lse, heads_o, cols_o + HALF, live, heads_o,
                    live, part, n_heads, HEAD_D, False)
        if MERGE:
            _merge_if_last(O, LSE, O_PART, LSE_PART, COUNT, SLOT_START, off_b, q_row, h0,
                           group, n_heads, stride_os, stride_oh, HEAD_D, LSE_BASE2, GROUP_P2,
                           MERGE_SLOTS)
    else:
        _store_out(O, LSE, o_lo * inv, lse, heads_o, cols_o, live, heads_o, live, q_row,
                   n_heads, stride_os, stride_oh, True)
        _store_out(O, LSE, o_hi * inv, lse, heads_o, cols_o + HALF, live, heads_o, live, q_row,
                   n_heads, stride_os, stride_oh, False)


@gluon.jit
def _decode_consumer(Q, O, LSE, O_PART, LSE_PART, q_smem, k_smem, v_smem, kc_smem, vc_smem,
                     full, empty, v_fixed,
                     q_row, stride_qs, stride_qh, stride_os, stride_oh, h0, group, n_heads, part,
                     start, lo, hi, n_tiles, qk_scale_log2, softcap_scale, COUNT, SLOT_START,
                     off_b, HEAD_D: gl.constexpr, STAGES_: gl.constexpr, LSE_BASE2: gl.constexpr,
                     MERGE: gl.constexpr, GROUP_P2: gl.constexpr, MERGE_SLOTS: gl.constexpr,
                     CONVERT: gl.constexpr, it0=0, SELF_ZERO: gl.constexpr = False,
                     CP_ASYNC_: gl.constexpr = False):
    """One item for one KV head, its key tiles from ring position it0, the GQA group on a 64-row
    wgmma tile (``_consumer_mma16``: on mma.sync); SELF_ZERO: the last tile's V rows past the
    request's keys zeroed here (else the producer zeroes them; CP_ASYNC_: its copies wrote them
    as zeros, and each tile is fenced for wgmma's proxy after its wait).
    softcap_scale: softcap's tanh(s · softcap_scale) on each score tile (qk_scale_log2 is then
    cap · log2 e, ``score_scales``), or None."""
    BLOCK_N_: gl.constexpr = k_smem.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = wgmma_acc_layout(BLOCK_N_)
    o_layout: gl.constexpr = wgmma_acc_layout(HEAD_D)
    p_layout: gl.constexpr = wgmma_a_operand(o_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    # the group's query heads as rows of a zero-padded [64, d] tile, staged for wgmma
    rows_o = gl.arange(0, ROWS, layout=row_o)
    cols_o = gl.arange(0, HEAD_D, layout=col_o)
    live = rows_o < group
    q_tile, q_exp = _load_q(Q, q_row, stride_qs, stride_qh, h0 + rows_o, live, cols_o, CONVERT)
    if CONVERT:  # (q scaled by 2^-q_exp: the raw scores, or softcap's tanh argument, undo it)
        if softcap_scale is None:
            qk_scale_log2 = qk_scale_log2 * gl.exp2(q_exp)
        else:
            softcap_scale = softcap_scale * gl.exp2(q_exp)
    q_smem.store(q_tile.to(dtype))
    fence_async_shared()

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N_], gl.float32, layout=s_layout)
    for j in range(n_tiles):
        st = (it0 + j) % STAGES_
        mbarrier.wait(full.index(st), ((it0 + j) // STAGES_) & 1)
        if CP_ASYNC_:  # (cp.async writes through the generic proxy; wgmma reads the async one)
            fence_async_shared()
        key0 = start + j * BLOCK_N_
        if CONVERT:
            # an fp8 cache: the stage's K and V converted to fp16 in the operand buffers (exact:
            # e4m3 / e5m2 values are fp16 values), V's slots past the request's keys zeroed on
            # the way (stale slots may hold NaN); the stage is then free
            _convert_tile(k_smem.index(st), kc_smem, BLOCK_N_)
            _convert_tile(v_smem.index(st), vc_smem, hi - key0)
            fence_async_shared()
            gl.thread_barrier()  # every warp's stores, before the warpgroup's wgmma reads them
            mbarrier.arrive(empty.index(st), count=1)
            k_op = kc_smem
            v_op = vc_smem
        else:
            k_op = k_smem.index(st)
            v_op = v_smem.index(st)
        s_tok = warpgroup_mma(q_smem, k_op.permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        s = softcap_tanh(s, softcap_scale)
        if (key0 < lo) | (key0 + BLOCK_N_ > hi):
            keys = key0 + gl.arange(0, BLOCK_N_, layout=col_s)
            s = gl.where(((keys >= lo) & (keys < hi))[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale_log2)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale_log2 - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        if not CONVERT and not CP_ASYNC_:
            if j == n_tiles - 1:
                if key0 + BLOCK_N_ > hi:  # V rows past the request's keys: zeroed
                    if SELF_ZERO:  # (in place, by the warpgroup, before its wgmma reads them)
                        zero_tail_rows(v_smem.index(st), hi - key0)
                        fence_async_shared()
                        gl.thread_barrier()
                    else:  # (by the producer)
                        mbarrier.wait(v_fixed, 0)
        acc_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_op, acc,
                                is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc_tok])
        if not CONVERT:
            mbarrier.arrive(empty.index(st), count=1)

    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    lse = gl.where(empty_row, float("-inf"), m_i + gl.log2(l_safe))
    if not LSE_BASE2:
        lse = lse * 0.6931471805599453
    acc = acc * gl.convert_layout(1.0 / l_safe, row_o)[:, None]
    rows_l = gl.arange(0, ROWS, layout=row_s)
    heads_l = (h0 + rows_l).to(gl.int64)
    heads_o = (h0 + rows_o).to(gl.int64)
    if part >= 0:
        _store_part(O_PART, LSE_PART, acc, lse, heads_o, cols_o, live, heads_l, rows_l < group,
                    part, n_heads, HEAD_D, True)
        if MERGE:
            _merge_if_last(O, LSE, O_PART, LSE_PART, COUNT, SLOT_START, off_b, q_row, h0,
                           group, n_heads, stride_os, stride_oh, HEAD_D, LSE_BASE2, GROUP_P2,
                           MERGE_SLOTS)
    else:
        _store_out(O, LSE, acc, lse, heads_o, cols_o, live, heads_l, rows_l < group, q_row,
                   n_heads, stride_os, stride_oh, True)


@gluon.jit
def _load_q(Q, q_row, stride_qs, stride_qh, heads, live, cols, CONVERT: gl.constexpr):
    """The query row's heads ``heads`` (rows where ``live``, zeros elsewhere) as a tile of the
    layout of heads / cols, and q_exp: CONVERT (fp16 operands) scales q by 2^-q_exp so that its
    largest |value| fits fp16 (<= 2^15), which the caller's score scale undoes exactly (as the
    portable kernel does; q_exp 0 otherwise)."""
    q_ptrs = (Q + q_row * stride_qs + heads[:, None].to(gl.int64) * stride_qh + cols[None, :])
    q_tile = gl.load(q_ptrs, mask=live[:, None], other=0.0)
    q_exp = 0.0
    if CONVERT:
        q_f = q_tile.to(gl.float32)
        q_abs = gl.abs(q_f)  # (over finite values: an inf must not zero the group's other heads)
        q_amax = gl.max(gl.max(gl.where(q_abs < float("inf"), q_abs, 0.0), axis=1), axis=0)
        q_exp = gl.maximum(gl.ceil(gl.log2(q_amax)) - 15.0, 0.0)
        q_tile = q_f * gl.exp2(-q_exp)
    return q_tile, q_exp


@gluon.jit
def _store_part(O_PART, LSE_PART, o, lse, heads_o, cols_o, live_o, heads_l, live_l, part,
                n_heads, HEAD_D: gl.constexpr, WITH_LSE: gl.constexpr):
    """A split request's item: its fp32 partial output columns cols_o of heads heads_o (and,
    WITH_LSE, its LSE of heads_l) in slot ``part`` (O_PART [slots, h, d], LSE_PART [slots, h]),
    merged afterwards."""
    base = part.to(gl.int64) * n_heads
    gl.store(O_PART + (base + heads_o)[:, None] * HEAD_D + cols_o[None, :], o,
             mask=live_o[:, None])
    if WITH_LSE:
        gl.store(LSE_PART + base + heads_l, lse, mask=live_l)


@gluon.jit
def _store_out(O, LSE, o, lse, heads_o, cols_o, live_o, heads_l, live_l, q_row, n_heads,
               stride_os, stride_oh, WITH_LSE: gl.constexpr):
    """An unsplit request's item: its output columns cols_o of heads heads_o (and, WITH_LSE,
    its LSE of heads_l)."""
    gl.store(O + q_row * stride_os + heads_o[:, None] * stride_oh + cols_o[None, :],
             o.to(O.dtype.element_ty), mask=live_o[:, None])
    if WITH_LSE:
        gl.store(LSE + q_row * n_heads + heads_l, lse, mask=live_l)


@gluon.jit
def _merge_if_last(O, LSE, O_PART, LSE_PART, COUNT, SLOT_START, off_b, q_row, h0, group, n_heads,
                   stride_os, stride_oh, HEAD_D: gl.constexpr, LSE_BASE2: gl.constexpr,
                   GROUP_P2: gl.constexpr, MERGE_SLOTS: gl.constexpr):
    """(MERGE) After an item's partials are stored: the request's last item to finish merges
    them (no combine launch): the whole warpgroup's stores, then one acquire-release ticket on
    the (request, KV head) counter; the merging CTA resets it for the next launch (graph
    replays)."""
    gl.thread_barrier()
    slot0 = gl.load(SLOT_START + off_b)
    n_parts = gl.load(SLOT_START + off_b + 1) - slot0
    ticket = gl.atomic_add(COUNT, 1, sem="acq_rel", scope="gpu")
    if ticket == n_parts - 1:
        _merge_parts(O, LSE, O_PART, LSE_PART, slot0, n_parts, q_row, h0, group, n_heads,
                     stride_os, stride_oh, HEAD_D, LSE_BASE2, GROUP_P2, MERGE_SLOTS, 4)
        gl.store(COUNT, 0)


@gluon.jit
def _merge_parts(O, LSE, O_PART, LSE_PART, slot0, n_parts, q_row, h0, group, n_heads, stride_os,
                 stride_oh, HEAD_D: gl.constexpr, LSE_BASE2: gl.constexpr, GROUP_P2: gl.constexpr,
                 SLOTS: gl.constexpr, WARPS: gl.constexpr):
    """One request's partials for the GQA group's heads, merged by their LSE (as the combine
    kernel does): SLOTS partials x GROUP_P2 heads x HEAD_D per step, loaded together (a serial
    walk is latency-bound), read past L1 (other SMs wrote them)."""
    # lanes along the head dim: 4 values each, HEAD_D / 4 lanes (the rest of the warp along the
    # heads), so no lane loads what another lane of its warp loads
    LANES_D: gl.constexpr = HEAD_D // 4 if HEAD_D < 128 else 32
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32 // LANES_D, LANES_D], [1, WARPS, 1],
                                        [2, 1, 0])
    L_sh: gl.constexpr = gl.SliceLayout(2, L3)  # [slots, heads]
    L_hd: gl.constexpr = gl.SliceLayout(0, L3)  # [heads, dims]
    slots = gl.arange(0, SLOTS, layout=gl.SliceLayout(1, L_sh))
    heads = gl.arange(0, GROUP_P2, layout=gl.SliceLayout(0, L_sh))
    dims = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    head_ok = heads < group
    heads3 = gl.expand_dims(gl.expand_dims(h0 + heads, 0), 2).to(gl.int64)  # [1, G, 1]
    dims3 = gl.expand_dims(gl.expand_dims(dims, 0), 1)  # [1, 1, D]
    m_i = gl.full([GROUP_P2, 1], float("-inf"), gl.float32, layout=L_hd)
    l_i = gl.zeros([GROUP_P2, 1], gl.float32, layout=L_hd)
    acc = gl.zeros([GROUP_P2, HEAD_D], gl.float32, layout=L_hd)
    for s0 in range(0, n_parts, SLOTS):
        ok = gl.expand_dims((s0 + slots) < n_parts, 1) & gl.expand_dims(head_ok, 0)  # [S, G]
        rows = gl.expand_dims(gl.expand_dims(slot0 + s0 + slots, 1), 2).to(gl.int64) * n_heads
        ok3 = gl.expand_dims(ok, 2)
        lse = gl.load(LSE_PART + rows + heads3, mask=ok3, other=float("-inf"),
                      cache_modifier=".cg")  # [S, G, 1]
        if not LSE_BASE2:
            lse = lse * 1.4426950408889634
        o = gl.load(O_PART + (rows + heads3) * HEAD_D + dims3, mask=ok3, other=0.0,
                    cache_modifier=".cg")  # [S, G, D]
        m_new = gl.maximum(m_i, gl.max(lse, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        w = gl.exp2(lse - gl.expand_dims(m_use, 0))  # empty partials (LSE -inf) weigh 0
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(w, axis=0)
        acc = acc * alpha + gl.sum(w * o, axis=0)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / gl.where(empty, 1.0, l_i)
    lse_out = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
    if not LSE_BASE2:
        lse_out = lse_out * 0.6931471805599453
    heads2 = gl.arange(0, GROUP_P2, layout=gl.SliceLayout(1, L_hd))
    dims2 = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, L_hd))
    h2 = gl.expand_dims(h0 + heads2, 1).to(gl.int64)  # [G, 1]
    ok2 = gl.expand_dims(heads2 < group, 1)
    gl.store(O + q_row * stride_os + h2 * stride_oh + gl.expand_dims(dims2, 0),
             out.to(O.dtype.element_ty), mask=ok2)
    gl.store(LSE + q_row * n_heads + h2, lse_out, mask=ok2)


@gluon.jit
def _item(WORK, SEQ, w, batch, capacity, BLOCK_N_: gl.constexpr, live=None,
          LIVE: gl.constexpr = False):
    """Work item w of the plan: (request, partial slot, first key, end key, first tile's key,
    key tiles, the request's page-table row and pages, its query row). LIVE: live False (w past
    the plan's items, whose WORK rows may be stale) reads request 0's row of SEQ instead."""
    off_b = gl.load(WORK + 5 * w)
    w_lo = gl.load(WORK + 5 * w + 2)
    w_hi = gl.load(WORK + 5 * w + 3)
    part = gl.load(WORK + 5 * w + 4)
    if LIVE:
        off_b = gl.where(live, off_b, 0)
    seqlen_k = gl.minimum(gl.maximum(gl.load(SEQ + off_b), 0), capacity)
    bt_row = gl.load(SEQ + batch + off_b)
    n_pages_b = gl.load(SEQ + batch + off_b + 1) - bt_row
    q_row = gl.load(SEQ + 2 * batch + 1 + off_b).to(gl.int64)
    lo = w_lo
    hi = gl.minimum(w_hi, seqlen_k)
    # tiles aligned to BLOCK_N keys (so page runs never straddle pages); keys [start, lo) are
    # the request's own earlier keys (written, finite), masked
    start = lo - lo % BLOCK_N_
    n_tiles = gl.cdiv(gl.maximum(hi - start, 0), BLOCK_N_)
    return off_b, part, lo, hi, start, n_tiles, bt_row, n_pages_b, q_row


@gluon.jit
def _decode_consumer_items(Q, O, LSE, O_PART, LSE_PART, q_smem, k_smem, v_smem, kc_smem, vc_smem,
                           full, empty, v_fixed, WORK, SEQ, p0, p1, batch, capacity, stride_qs,
                           stride_qh, stride_os, stride_oh, h0, group, n_heads, qk_scale_log2,
                           softcap_scale, COUNTS, SLOT_START, off_hk, HEAD_D: gl.constexpr,
                           STAGES_: gl.constexpr, LSE_BASE2: gl.constexpr, MERGE: gl.constexpr,
                           GROUP_P2: gl.constexpr, MERGE_SLOTS: gl.constexpr,
                           CONVERT: gl.constexpr, KV_AXIS: gl.constexpr,
                           MMA16_: gl.constexpr = False):
    """(BALANCED) The consumer over items p0 .. p1 - 1, the ring running on from one to the
    next; it zeroes V's rows past each request's keys itself (a producer ahead by two items
    would otherwise complete ``v_fixed``'s phases faster than they are waited for)."""
    BLOCK_N_: gl.constexpr = k_smem.shape[1]
    it = p0 * 0  # key tiles consumed so far (ring position)
    for w in range(p0, p1):
        off_b, part, lo, hi, start, n_tiles, bt_row, n_pages_b, q_row = _item(
            WORK, SEQ, w, batch, capacity, BLOCK_N_)
        gl.thread_barrier()  # the last item's wgmmas have read Q before it is replaced
        (_consumer_mma16 if MMA16_ else _decode_consumer)(  # (MMA16_: at compile time)
            Q, O, LSE, O_PART, LSE_PART, q_smem, k_smem, v_smem, kc_smem, vc_smem, full, empty,
            v_fixed, q_row, stride_qs, stride_qh, stride_os, stride_oh, h0, group, n_heads, part,
            start, lo, hi, n_tiles, qk_scale_log2, softcap_scale,
            COUNTS + off_b * gl.num_programs(KV_AXIS) + off_hk, SLOT_START, off_b, HEAD_D,
            STAGES_, LSE_BASE2, MERGE, GROUP_P2, MERGE_SLOTS, CONVERT, it, True)
        it += n_tiles


@gluon.jit
def _decode_producer_items(k_desc, v_desc, k_smem, v_smem, full, empty, v_fixed, INDICES, WORK,
                           SEQ, p0, p1, batch, capacity, row_off, page_rows, col,
                           PAGE: gl.constexpr, STAGES_: gl.constexpr, CONVERT: gl.constexpr,
                           ROWS_AHEAD_: gl.constexpr = False):
    """(BALANCED) The producer over items p0 .. p1 - 1, the ring running on."""
    BLOCK_N_: gl.constexpr = k_smem.shape[1]
    it = p0 * 0
    for w in range(p0, p1):
        off_b, part, lo, hi, start, n_tiles, bt_row, n_pages_b, q_row = _item(
            WORK, SEQ, w, batch, capacity, BLOCK_N_)
        _decode_producer(k_desc, v_desc, k_smem, v_smem, full, empty, v_fixed, INDICES, bt_row,
                         n_pages_b, start, n_tiles, hi - start, row_off, page_rows, col, PAGE,
                         STAGES_, CONVERT, it, True, ROWS_AHEAD_)
        it += n_tiles


@gluon.jit
def _prefetch_item(K_RAW, V_RAW, k_row_stride, v_row_stride, view_rows, INDICES, WORK, SEQ,
                   n_work, w, batch, capacity, row_off, page_rows, col, PAGE: gl.constexpr,
                   HEAD_D: gl.constexpr, BLOCK_N_: gl.constexpr, TILES: gl.constexpr):
    """L2 prefetches of item w's first TILES key tiles (each key slot's K and V row of this KV
    head: HEAD_D elements), one slot a thread at a time over the CTA's 128 threads. Rows are
    clamped to the views' view_rows: a page table the previous kernel is still writing may
    hold anything here."""
    if w < n_work:
        off_b, part, lo, hi, start, n_tiles, bt_row, n_pages_b, q_row = _item(
            WORK, SEQ, w, batch, capacity, BLOCK_N_)
        _prefetch_tiles(K_RAW, V_RAW, k_row_stride, v_row_stride, view_rows, INDICES, start, hi,
                        bt_row, n_pages_b, row_off, page_rows, col, PAGE, HEAD_D, BLOCK_N_,
                        TILES)


@gluon.jit
def _prefetch_tiles(K_RAW, V_RAW, k_row_stride, v_row_stride, view_rows, INDICES, start, hi,
                    bt_row, n_pages_b, row_off, page_rows, col, PAGE: gl.constexpr,
                    HEAD_D: gl.constexpr, BLOCK_N_: gl.constexpr, TILES: gl.constexpr):
    """(``_prefetch_item``) The L2 prefetches of the key tiles from start (keys below hi)."""
    N: gl.constexpr = 256  # key slots, two a thread (arange takes a power of two)
    gl.static_assert(TILES * BLOCK_N_ <= N)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    keys = start + gl.arange(0, N, layout=layout)
    ok = keys < gl.minimum(hi, start + TILES * BLOCK_N_)
    rows = _slot_row(INDICES, bt_row, n_pages_b, keys, page_rows, row_off, PAGE, ok)
    rows = gl.minimum(gl.maximum(rows, 0), view_rows - 1)
    k_addr = (K_RAW + rows * k_row_stride + col).to(gl.int64, bitcast=True)
    v_addr = (V_RAW + rows * v_row_stride + col).to(gl.int64, bitcast=True)
    nbytes = gl.full([N], HEAD_D * K_RAW.dtype.element_ty.primitive_bitwidth // 8, gl.int32,
                     layout=layout)
    gl.inline_asm_elementwise(
        "{ .reg .pred %p; setp.ne.u32 %p, $4, 0; "
        "@%p cp.async.bulk.prefetch.L2.global [$1], $3; "
        "@%p cp.async.bulk.prefetch.L2.global [$2], $3; mov.u32 $0, 0; }",
        "=r,l,l,r,r", [k_addr, v_addr, nbytes, ok.to(gl.int32)], dtype=gl.int32,
        is_pure=False, pack=1)


@gluon.jit
def _now_ns():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _smid():
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _claim_unit(CLAIMS, n_units, n_ctas, n_sms, SPREAD: gl.constexpr):
    """The unit (item x KV heads + head) this CTA runs (``CLAIM``), or n_units or more for
    none. CLAIMS [CLAIM_WORDS] int32, zero between launches: the last CTA to claim zeroes it.
    SPREAD: only first CTAs on n_units SMs spread evenly over the ids claim at once
    (``CLAIM_SPREAD``)."""
    smid = _smid()
    nth = gl.atomic_add(CLAIMS + 2 + smid % CLAIM_SMS, 1)
    late = nth > 0
    if SPREAD:  # SM s is in the subset when (s + 1) * units / SMs passes an integer
        late = late | ((smid + 1) * n_units // n_sms == smid * n_units // n_sms)
    if late:  # another CTA ran on this SM first: let the SMs without one take the units
        t0 = _now_ns()
        seen = gl.atomic_add(CLAIMS, 0)
        waited = t0 - t0
        while (seen < n_units) & (waited < CLAIM_WAIT_NS):
            seen = gl.atomic_add(CLAIMS, 0)
            waited = _now_ns() - t0
    u = gl.atomic_add(CLAIMS, 1)
    if gl.atomic_add(CLAIMS + 1, 1) == n_ctas - 1:  # every CTA has claimed: zero for the next
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        offs = gl.arange(0, 2 * CLAIM_SMS, layout=layout)
        gl.store(CLAIMS + offs, gl.zeros_like(offs), mask=offs < 2 + CLAIM_SMS)
    return u


@gluon.jit
def _decode_sm90(k_desc, v_desc, Q, O, LSE, O_PART, LSE_PART, SEQ, INDICES, WORK, N_WORK,
                 COUNTS, SLOT_START, K_RAW, V_RAW, k_row_stride, v_row_stride,
                 stride_qs, stride_qh, stride_os, stride_oh, batch, n_heads, group, capacity,
                 page_rows, head_rows, head_cols, qk_scale_log2,
                 PAGE: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_N_: gl.constexpr,
                 STAGES_: gl.constexpr, LSE_BASE2: gl.constexpr, PRODUCER_REGS_: gl.constexpr,
                 MERGE: gl.constexpr = False, GROUP_P2: gl.constexpr = 1,
                 MERGE_SLOTS: gl.constexpr = 1, CONVERT: gl.constexpr = False,
                 BALANCED: gl.constexpr = False, COLS=None, softcap_scale=None,
                 PDL: gl.constexpr = False, HEADS_FIRST: gl.constexpr = False,
                 PREFETCH_: gl.constexpr = False, view_rows=None,
                 CLAIMS=None, n_sms=0, CLAIM_: gl.constexpr = False,
                 CLAIM_SPREAD_: gl.constexpr = False,
                 CP_ASYNC_: gl.constexpr = False, PRODUCER_WARPS_: gl.constexpr = 1,
                 ROWS_AHEAD_: gl.constexpr = False, SHALLOW_: gl.constexpr = False,
                 MMA16_: gl.constexpr = False, EARLY_: gl.constexpr = False):
    # MERGE: split requests are merged in the kernel by their last item (COUNTS [batch * KV
    # heads] int32 tickets, zero between launches; SLOT_START [batch + 1] the partial slots),
    # GROUP_P2 / MERGE_SLOTS the merge's tile (``_merge_parts``)
    # work item w = (request, row block, first key, end key, partial slot or -1) of the plan
    # (``ioattn.paged.plan``); SEQ holds the kv lengths [batch], kv indptr [batch + 1] and qo
    # indptr [batch + 1]; the grid is (items a plan may produce, KV heads), or (BALANCED) the
    # plan's columns x KV heads, column c's items being WORK rows COLS[c] .. COLS[c + 1] - 1;
    # HEADS_FIRST: the grid's axes swapped (KV heads, items), so the CTAs of one item's heads
    # are launched side by side and read the same cache rows (NHD: every head's slice of a key
    # slot's row) at about the same time; PREFETCH_ (with PDL, one item a CTA): L2 prefetches
    # of the item's first tiles before the wait (``PREFETCH``; K_RAW / V_RAW the caches' views'
    # bases, rows k_row_stride / v_row_stride elements apart, view_rows rows: None without
    # prefetches, as one more scalar argument made the balanced fp8 forms spill 64 B);
    # CLAIM_ (CLAIMS [CLAIM_WORDS] int32 zeros, n_sms the SM count): where the work's units are
    # fewer than the grid and at most n_sms, each CTA runs the unit it claims (``_claim_unit``)
    # instead of its grid position's (``CLAIM``); CLAIM_SPREAD_ the even SM subset's claim;
    # CP_ASYNC_ (one item a CTA, bf16 / fp16): the producer's PRODUCER_WARPS_ warps
    # (PRODUCER_REGS_ registers) fill the ring by cp.async from K_RAW / V_RAW (``CP_ASYNC``);
    # ROWS_AHEAD_: the TMA producer's page-table loads a tile ahead (``ROWS_AHEAD``);
    # SHALLOW_ (n_sms the SM count): two tiles in flight a CTA when the work's units outnumber
    # the SMs, so that CTAs share them (``SHALLOW``); MMA16_: the consumer on mma.sync (``MMA16``);
    # EARLY_ (one item a CTA; n_sms the SM count): the item read before PDL's wait, prefetches
    # from the first 2 * n_sms CTAs only (``EARLY``)
    KV_AXIS: gl.constexpr = 0 if HEADS_FIRST else 1
    w = gl.program_id(1 - KV_AXIS)
    off_hk = gl.program_id(KV_AXIS)
    n_kv = gl.num_programs(KV_AXIS)
    claim = False
    if not BALANCED:  # (N_WORK is written by copies only, so it may be read before the wait)
        n_work = gl.load(N_WORK)
    if CLAIM_:
        n_units = n_work * n_kv
        claim = (n_units < gl.num_programs(0) * gl.num_programs(1)) & (n_units <= n_sms)
    if EARLY_:  # (one item a CTA) the item read before PDL's wait (``EARLY``)
        off_b, part, lo, hi, start, n_tiles, bt_row, n_pages_b, q_row = _item(
            WORK, SEQ, w, batch, capacity, BLOCK_N_, w < n_work, True)
    if PDL:  # launched with launch_pdl: the previous kernel may still run (see ``PDL``)
        if PREFETCH_:
            if EARLY_:  # (the CTAs of the first wave only: later ones find no kernel to wait for)
                first = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0) < 2 * n_sms
                if not claim:
                    if (w < n_work) & first:
                        _prefetch_tiles(K_RAW, V_RAW, k_row_stride, v_row_stride, view_rows,
                                        INDICES, start, hi, bt_row, n_pages_b,
                                        off_hk.to(gl.int64) * head_rows, page_rows,
                                        off_hk * head_cols, PAGE, HEAD_D, BLOCK_N_, STAGES_)
            elif not claim:
                _prefetch_item(K_RAW, V_RAW, k_row_stride, v_row_stride, view_rows, INDICES,
                               WORK, SEQ, n_work, w, batch, capacity,
                               off_hk.to(gl.int64) * head_rows, page_rows, off_hk * head_cols,
                               PAGE, HEAD_D, BLOCK_N_, STAGES_)
        grid_dependency_wait()
        launch_dependents()
    if CLAIM_:
        if claim:
            u = _claim_unit(CLAIMS, n_units, gl.num_programs(0) * gl.num_programs(1), n_sms,
                            CLAIM_SPREAD_)
            w = u // n_kv
            off_hk = u % n_kv
    depth = 0
    if not BALANCED:
        if w >= n_work:
            return
        if SHALLOW_:
            if n_work * n_kv > n_sms:
                depth = 2
        if EARLY_:
            if claim:  # (the claimed unit's item)
                off_b, part, lo, hi, start, n_tiles, bt_row, n_pages_b, q_row = _item(
                    WORK, SEQ, w, batch, capacity, BLOCK_N_)
        else:
            off_b, part, lo, hi, start, n_tiles, bt_row, n_pages_b, q_row = _item(
                WORK, SEQ, w, batch, capacity, BLOCK_N_)

    # CONVERT: an fp8 cache (the ring holds fp8 tiles): the wgmma operands are fp16 (e4m3 / e5m2
    # -> fp16 is one conversion per pair of values, -> bf16 two more per value; q is staged in
    # fp16, P in [0, 1] loses nothing), else q's dtype
    op_dtype: gl.constexpr = gl.float16 if CONVERT else Q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_D], op_dtype)
    q_smem = gl.allocate_shared_memory(op_dtype, [ROWS, HEAD_D], q_layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES_, BLOCK_N_, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES_, BLOCK_N_, HEAD_D], v_desc.layout)
    if CONVERT:
        op_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N_, HEAD_D], op_dtype)
        kc_smem = gl.allocate_shared_memory(op_dtype, [BLOCK_N_, HEAD_D], op_layout)
        vc_smem = gl.allocate_shared_memory(op_dtype, [BLOCK_N_, HEAD_D], op_layout)
    else:
        kc_smem = q_smem  # (unused)
        vc_smem = q_smem
    full = barriers(STAGES_, PRODUCER_WARPS_ * 32 if CP_ASYNC_ else 1)
    empty = barriers(STAGES_, 1)
    v_fixed = barriers(1, 1)
    fence_async_shared()

    h0 = off_hk * group
    if BALANCED:
        p0 = gl.load(COLS + w)
        p1 = gl.load(COLS + w + 1)
        gl.warp_specialize([
            (_decode_consumer_items, (Q, O, LSE, O_PART, LSE_PART, q_smem, k_smem, v_smem,
                                      kc_smem, vc_smem, full, empty, v_fixed.index(0), WORK, SEQ,
                                      p0, p1, batch, capacity, stride_qs, stride_qh, stride_os,
                                      stride_oh, h0, group, n_heads, qk_scale_log2,
                                      softcap_scale, COUNTS, SLOT_START, off_hk, HEAD_D, STAGES_,
                                      LSE_BASE2, MERGE,
                                      GROUP_P2, MERGE_SLOTS, CONVERT, KV_AXIS, MMA16_)),
            (_decode_producer_items, (k_desc, v_desc, k_smem, v_smem, full, empty,
                                      v_fixed.index(0), INDICES, WORK, SEQ, p0, p1, batch,
                                      capacity, off_hk.to(gl.int64) * head_rows, page_rows,
                                      off_hk * head_cols, PAGE, STAGES_, CONVERT,
                                      ROWS_AHEAD_)),
        ], [1], [PRODUCER_REGS_])
    else:
        gl.warp_specialize([
            (_consumer_mma16 if MMA16_ else _decode_consumer,  # (MMA16_: at compile time)
             (Q, O, LSE, O_PART, LSE_PART, q_smem, k_smem, v_smem, kc_smem, vc_smem, full, empty,
              v_fixed.index(0), q_row, stride_qs, stride_qh, stride_os, stride_oh, h0, group,
              n_heads, part, start, lo, hi, n_tiles, qk_scale_log2, softcap_scale,
              COUNTS + off_b * gl.num_programs(KV_AXIS) + off_hk, SLOT_START, off_b, HEAD_D,
              STAGES_, LSE_BASE2, MERGE, GROUP_P2, MERGE_SLOTS, CONVERT, 0, False, CP_ASYNC_)),
            (_decode_producer_one, (k_desc, v_desc, k_smem, v_smem, full, empty,
                                    v_fixed.index(0), INDICES, bt_row, n_pages_b, start, n_tiles,
                                    hi - start, off_hk.to(gl.int64) * head_rows, page_rows,
                                    off_hk * head_cols, K_RAW, V_RAW, k_row_stride,
                                    v_row_stride, PAGE, STAGES_, HEAD_D, CONVERT, CP_ASYNC_,
                                    ROWS_AHEAD_, depth)),
        ], [PRODUCER_WARPS_], [PRODUCER_REGS_])

    invalidate(full, STAGES_)
    invalidate(empty, STAGES_)
    invalidate(v_fixed, 1)


def _row_view(t: torch.Tensor):
    """(page_rows, head_rows, head_cols, row_elems, row_stride) of a [pages, page_size, H_kv, D]
    cache view as 2-D rows of key slots (see the module doc), or None when its strides do not
    allow one: NHD (heads within a row) or HND (one head per row, heads page_size rows apart)."""
    pages, page, h_k, d = t.shape
    sp, ss, sh, sd = t.stride()
    if sd != 1 or ss <= 0 or sp % ss:
        return None
    if sh == d and ss >= h_k * d:  # NHD: a row holds every head
        return sp // ss, 0, d, h_k * d, ss
    if ss == d and sh % ss == 0:  # HND: a row holds one head
        return sp // ss, sh // ss, 0, d, ss
    return None


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows_per_request: int,
                       extras: bool) -> Optional[str]:
    """Why ``paged_decode_sm90`` does not cover a planned call (None when it does): q [total_q,
    h, d] with one row per request, k / v [pages, page_size, H_kv, D] views of one cache."""
    from ioattn.dispatch import sm90_unavailable_reason

    return sm90_unavailable_reason(q.device) or coverage_problem(q, k, v, rows_per_request, extras)


def coverage_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows_per_request: int,
                     extras: bool) -> Optional[str]:
    """``unsupported_reason`` without the platform check: what about the call itself (features,
    head dim, dtypes, page size, cache layout) the kernel does not cover."""
    d = q.shape[-1]
    group = q.shape[-2] // k.shape[2]
    if rows_per_request != 1 or extras:
        return ("the sm90 decode kernel takes one query row per request, no RoPE, custom mask "
                "or window")
    if d not in SUPPORTED_HEAD_DIMS or v.shape[-1] != d:
        return f"head_dim {d}: the sm90 decode kernel takes {SUPPORTED_HEAD_DIMS}"
    fp8 = FP8 and k.dtype in FP8_DTYPES
    if q.dtype not in OPERAND_DTYPES or (k.dtype != q.dtype and not fp8) or v.dtype != k.dtype:
        return ("the sm90 decode kernel takes fp16/bf16 caches of q's dtype" + (
            " (fp8 caches: IOATTN_SM90_DECODE_FP8=1)" if k.dtype in FP8_DTYPES and not FP8 else ""))
    if group > ROWS.value:
        return f"a GQA group of {group} query heads is more than the {ROWS.value} rows of a tile"
    page = k.shape[1]
    if page % 8 or (BLOCK_N % page and page % BLOCK_N):
        return (f"page_size {page}: TMA copies whole page runs (a multiple of 8 that divides, or "
                f"is a multiple of, {BLOCK_N} keys)")
    views = []
    for name, t in (("k", k), ("v", v)):
        view = _row_view(t)
        if view is None:
            return f"the {name} cache's strides {tuple(t.stride())} do not form rows of key slots"
        if t.data_ptr() % 16 or (view[4] * t.element_size()) % 16:
            return f"the {name} cache is not 16-byte aligned (base or row stride), as TMA requires"
        views.append(view)
    if views[0][:4] != views[1][:4]:
        return "the k and v caches must have the same layout"
    return None


def _descriptor(t: torch.Tensor, view: tuple, box: int) -> Desc:
    """The cache view's TMA descriptor (checked as gluon's ``TensorDescriptor`` by the launcher
    the first time its signature is seen)."""
    page_rows, head_rows, head_cols, row_elems, row_stride = view
    pages, page, h_k, _ = t.shape
    rows = (pages - 1) * page_rows + (h_k - 1) * head_rows + page  # the view's last row + 1
    return Desc(t, (rows, row_elems), (row_stride, 1), (box, t.shape[-1]),
                shared_layout(box, t.shape[-1], t.dtype))


def launch_maxnreg(d: int) -> int:
    """Registers a thread the kernel compiles and launches for at head dim d (``MAXNREG``,
    ``MAXNREG_D256``)."""
    return MAXNREG if d <= 128 else MAXNREG_D256


def launch_constexprs(d: int, page: int, group: int, fp8: bool, merge: bool,
                      balanced: bool = False, pdl: bool = False,
                      heads_first: bool = False, prefetch: bool = False,
                      claim: bool = False) -> dict:
    """The kernel's constexprs for a cache of head dim d and pages of ``page`` keys, a GQA group
    of ``group`` query heads, an fp8 cache or not, the merge in the kernel or not, a balanced
    plan's columns or one item a CTA, programmatic dependent launch or not, the grid as (KV
    heads, items) or not, L2 prefetches before PDL's wait or not (not in the balanced form,
    where they made the fp8 softcap kernel spill; the launch and the compile checks of
    ``ioattn.dense.inspect``), CTAs claiming their units (``CLAIM``) or not; LSE_BASE2 is the
    caller's."""
    group_p2 = 1 << (group - 1).bit_length()
    cp = CP_ASYNC and not fp8 and not balanced
    return dict(PAGE=page, HEAD_D=d, BLOCK_N_=BLOCK_N, STAGES_=STAGES_FP8 if fp8 else STAGES,
                PRODUCER_REGS_=CP_REGS if cp else PRODUCER_REGS,
                PRODUCER_WARPS_=CP_WARPS if cp else 1, MERGE=merge, GROUP_P2=group_p2,
                MERGE_SLOTS=max(1, min(32, 8192 // (group_p2 * d))), CONVERT=fp8,
                BALANCED=balanced, PDL=pdl, HEADS_FIRST=heads_first,
                PREFETCH_=prefetch and pdl and not balanced, CLAIM_=claim and not balanced,
                CLAIM_SPREAD_=claim and not balanced and CLAIM_SPREAD,
                CP_ASYNC_=cp, ROWS_AHEAD_=ROWS_AHEAD and not cp,
                SHALLOW_=SHALLOW and not cp and not fp8 and not balanced,
                MMA16_=MMA16 and group <= MMA16_ROWS.value and d <= 128,
                EARLY_=EARLY and not balanced)


def paged_decode_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                      seqlens_indptr: torch.Tensor, work: torch.Tensor, n_work: torch.Tensor,
                      max_items: int, o_part: torch.Tensor, lse_part: torch.Tensor,
                      softmax_scale: float, out: torch.Tensor, lse: torch.Tensor,
                      lse_base2: bool, merge: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                      columns: Optional[torch.Tensor] = None, softcap: float = 0.0,
                      pdl: Optional[bool] = None, claims: Optional[torch.Tensor] = None) -> None:
    """The planned decode's attention launch (``triton_decode.paged_attn``'s arguments) on the
    sm90 kernel. Split requests' partials are merged by the caller, or, with merge=(counts
    [batch * KV heads] int32 zeros, slot_start [batch + 1]), by the kernel itself (the last
    item of each request; counts return to zero). columns [C + 1] (a balanced plan,
    ``ioattn.paged.plan.split_work_balanced``): one CTA per column and KV head, looping over the
    column's items. pdl: launched with programmatic dependent launch (None: ``PDL``). claims
    [CLAIM_WORDS] int32 zeros (the grid of max_items a graph's bound): the CTAs claim their
    units SM by SM when the work fits one an SM (``CLAIM``; not with columns). n_work (and, with
    ``EARLY``, work and seqlens_indptr) is read before PDL's wait: written by copies, not by the
    kernel launched just before this one (the decode wrapper's plan() copies them from the
    host). Covered calls: ``unsupported_reason``."""
    total_q, h, d = q.shape
    h_k, page = k.shape[2], k.shape[1]
    batch = (seqlens_indptr.shape[0] - 2) // 3
    if max_items * h_k == 0:
        return
    pdl = PDL if pdl is None else bool(pdl)
    # a repeat of a launch seen before (the same cache, plan buffers, shapes and settings;
    # each layer of a step is one): one C call with this call's q, out and lse (``_BOUND``)
    key = (q.device, sm_count(q.device), q.dtype, q.shape, q.stride(),
           q.data_ptr() % 16 == 0, k.dtype, k.shape, k.stride(), k.data_ptr(), v.dtype, v.shape,
           v.stride(), v.data_ptr(), out.dtype, out.stride(), out.data_ptr() % 16 == 0,
           lse.dtype, lse.stride(), lse.data_ptr() % 16 == 0, indices.dtype, indices.data_ptr(),
           indices.shape[0], seqlens_indptr.data_ptr(), seqlens_indptr.shape[0],
           work.data_ptr(), n_work.data_ptr(), max_items, o_part.data_ptr(),
           lse_part.data_ptr(), softmax_scale, lse_base2,
           None if merge is None else (merge[0].data_ptr(), merge[1].data_ptr()),
           None if columns is None else (columns.data_ptr(), columns.numel()), softcap, pdl,
           None if claims is None else claims.data_ptr(), _switches())
    if repeat(_BOUND, key, q.data_ptr(), out.data_ptr(), lse.data_ptr()):
        return
    box = min(page, BLOCK_N)
    # one descriptor per view, each from its own base (interleaved pages or separate pools,
    # the same layout: ``coverage_problem``)
    view, v_view = _row_view(k), _row_view(v)
    k_desc = _descriptor(k, view, box)
    v_desc = _descriptor(v, v_view, box)
    page_rows, head_rows, head_cols = view[:3]
    group = h // h_k
    fp8 = k.dtype != q.dtype  # (an fp8 cache: ``coverage_problem``)
    counts, slot_start = merge if merge is not None else (n_work, n_work)
    grid = (max_items if columns is None else columns.numel() - 1, h_k)
    # (heads first puts the items on the grid's y axis, which CUDA caps at 65535)
    heads_first = HEADS_FIRST and grid[0] <= 65535
    if heads_first:
        grid = grid[::-1]
    qk_scale_log2, softcap_scale = score_scales(softmax_scale, softcap)
    claim = CLAIM and claims is not None and columns is None
    consts = launch_constexprs(d, page, group, fp8, merge is not None, columns is not None, pdl,
                               heads_first, PREFETCH, claim)
    launcher(_decode_sm90).bind_kept(_BOUND, key, grid, (
        k_desc, v_desc, q, out, lse, o_part, lse_part, seqlens_indptr, indices, work, n_work,
        counts, slot_start, k, v, view[4], v_view[4],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), batch, h, group,
        indices.shape[0] * page, page_rows, head_rows, head_cols, qk_scale_log2), dict(
        LSE_BASE2=lse_base2, softcap_scale=softcap_scale,
        **consts, COLS=columns, view_rows=k_desc.shape[0] if consts["PREFETCH_"] else None,
        CLAIMS=claims if claim else None,
        n_sms=sm_count(q.device) if claim or consts["SHALLOW_"] or consts["EARLY_"] else 0,
        num_warps=4, maxnreg=launch_maxnreg(d), launch_pdl=pdl), slots=(2, 3, 4))  # (q, out, lse)


# ``paged_decode_sm90``'s launches kept for repeats (``launch.Bound``: the flattened arguments,
# TMA descriptors encoded, tensors as addresses), by everything the arguments derive from but
# q, out and lse (their alignment only): a model's layers each repeat one per step (the
# decode wrapper's buffers, its eager page table included, keep their addresses from plan to
# plan; a plan whose item count changes, or a new batch size, makes new keys). The
# wrapper's run() cost ~200 us of host time a call on the H100 machine through the launcher's
# per-call signature, Triton's descriptor encoding and its pointer checks
# (results/tune/host_sm90dec_0e6b35a_nvidia-h100_2026-12-06.*)
_BOUND: dict = {}


def _switches() -> tuple:
    """The module settings a launch reads (tests and benchmarks/read_probe.py change some)."""
    return (STAGES, STAGES_FP8, FP8, CP_ASYNC, CP_REGS, CP_WARPS, PRODUCER_REGS, ROWS_AHEAD,
            SHALLOW, MMA16, EARLY, PDL, HEADS_FIRST, PREFETCH, CLAIM, CLAIM_SPREAD, MAXNREG,
            MAXNREG_D256, BLOCK_N)

"""Hopper (sm90) attention backward in Gluon: warp-specialized, TMA-fed, async wgmma.

Two kernels after the portable preprocess (delta = rowsum(dO * O) - dLSE), both without atomics,
so the backward stays deterministic, as the portable one is:
- dK/dV: one CTA per 128-key block of one KV head. A 1-warp producer loads the block's K and V
  halves once, then streams Q and dO tiles (64 query rows) of every query head of the GQA group
  through a ring of shared-memory stages. Two consumer warpgroups own 64 keys each and keep dK
  and dV in registers (64 x d fp32 each): per tile, Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (shared-memory
  operands), Pᵀ = exp2(Sᵀ - LSE), dSᵀ = Pᵀ(dPᵀ - delta), then dV += Pᵀ·dO and dK += dSᵀ·Q with Pᵀ
  and dSᵀ as register operands.
- dQ: one CTA per 128 query rows of one head, the forward's shape: Q and dO halves loaded once,
  K and V streamed; per key block S = Q·Kᵀ, dP = dO·Vᵀ, dS = P(dP - delta), dQ += dS·K. (Queueing
  the next block's S and dP behind dQ, with one more K/V stage, measured 0.87-0.96x: removed,
  benchmarks/NOTES.md.)
- d = 256 (``D256``, on by default): dK/dV of 64 keys per CTA split by columns between the two
  warpgroups (``_dkdv_cols_consumer``), then the dQ kernel on 32-key K/V tiles.

Layouts and coverage are the forward's (``sm90_fwd``): [rows, heads * d] views through host TMA
descriptors, d = d_v in {64, 128, 256} here, causal/window, GQA, batched and varlen,
fp16/bf16. As there, varlen tiles that run past the last sequence get those rows zeroed by the
producer (Q and dO in dK/dV, K and V in dQ and in the fused form) before the consumers read them.
(The d = 256 dK/dV kernel leaves K/V rows past a sequence as they are: they reach only their own
dK/dV rows, never stored; a dQ formed there would need them zeroed, as the fused form does.)

Compiled for sm90 in CI (``python -m ioattn.dense.inspect --gluon``); the dense suite runs through it
on the H200 (``IOATTN_TEST_SM90=always``). The public functions pick it per call
(``ioattn.dense.api._pick``), independently of the forward's kernel.

Fused form (``FUSED``, the default; ``IOATTN_SM90_FUSED_BWD=0`` turns it off): the dK/dV kernel also forms
each step's dQ partial dS·K and adds it to an fp32 buffer with a TMA reduction
(``sm90_common.tma_reduce_add``): 5 GEMMs per tile instead of 7, and no dQ kernel. Both
warpgroups' dSᵀ go to one [128 keys, 64 rows] shared buffer (two, alternating by step); from
d = 128 each warpgroup then forms half of the partial's columns over all 128 keys, so one 64 x d
partial per step leaves the CTA (``dq_cols``). As in FA3, a 1-warp dQ writer (``_dq_writer``)
issues the reductions from shared memory, so the consumers hand over a partial and go on. On the
H200: one full partial per warpgroup 350 TFLOP/s at d=128 16k, the column split (reductions
issued by the consumers) 395, against 452 for the two-kernel form (benchmarks/NOTES.md); with
the writer warp 1.02-1.04x the two-kernel form at d=64 and 128 (457 vs 450 at d=128 16k,
results/sm90_bwd_fused_writer{1,0}_*.json). The reductions' order varies, so
``deterministic=True`` keeps the two-kernel form.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ioattn.dense import sm90_common
from ioattn.dense.params import AttnParams
from ioattn.dense.sm90_common import (PADDED_HEAD_DIMS, barriers, box_cols, floor_div,
                                      invalidate, query_tile, query_tiles, rows_descriptor,
                                      score_scales, seq_bounds, softcap_tanh, store_cols,
                                      tile_layout, tma_load, tma_reduce_add, stage_tma_store,
                                      wgmma_a_operand, tma_view_problem, base_problem,
                                      wgmma_acc_layout, zero_last_key_tile, zero_tail_rows,
                                      grouped_order, head_group_size, mma_over_cols)
from ioattn.dispatch import sm_count
from ioattn.dense.triton_bwd import bwd_preprocess
from ioattn.launch import keep, launcher

HALF = gl.constexpr(64)  # rows of one consumer warpgroup's wgmma (keys in dK/dV, queries in dQ)
# d = 256 (the column-split dK/dV kernel and the dQ kernel on 32-key tiles): on by default since
# it measured 1.01-1.14x cuDNN from 2k on the H200, 2.7-3.0x the portable backward
# (results/dense_76fc236_*.json; first run results/sm90_bwd_d256_a0cfad4_*.json);
# IOATTN_SM90_BWD_D256=0 turns it off
D256 = os.environ.get("IOATTN_SM90_BWD_D256", "1").lower() not in ("0", "false", "off")
SUPPORTED_HEAD_DIMS = (64, 128, 256) if D256 else (64, 128)
CONSUMER_REGS = 240
PRODUCER_REGS = 24
DKDV_STAGES = 2
# (the d = 64 dK/dV kernel) Q/dO ring stages, IOATTN_SM90_BWD_STAGES: "auto" (default) 2, or 3 /
# 4 on 64-row steps (``ROWS_MODE`` 64; the 128-row steps take 194 KB at 2). 64-row steps take
# 132 / 150 / 166 KB of shared memory at 2 / 3 / 4 stages, spill-free (with 2
# the producer runs one 1.44 us step ahead of the consumers at 2k, about an L2 round trip under
# load). Timed on the H200 with cuDNN in each run (results/bwd_stages{2,3,4}_e33e22c_*.json):
# 3 stages 1-5% slower non-causal, 4 within -1 / +1.4% of 2, so 2 stays. d = 128 has no room
# for a third stage (231 KB).
STAGES_MODE = os.environ.get("IOATTN_SM90_BWD_STAGES", "auto").lower()
DQ_BLOCK_N = 64
DQ_STAGES = 2
# The fused backward (dQ by TMA reductions in the dK/dV kernel, issued by a writer warp): on by
# default since it measured 1.02-1.04x the two-kernel form at d=64 and 128 from 2k on the H200
# (results/sm90_bwd_fused_writer{1,0}_*.json); IOATTN_SM90_FUSED_BWD=0 turns it off
FUSED = os.environ.get("IOATTN_SM90_FUSED_BWD", "1").lower() not in ("0", "false", "off")
# (fused) where each step's dQ partial is issued (``dq_order``): "after" dK's update, "first"
# (before it: dK's GEMM overlaps the partial's hand-off to the writer warp), "lag" (one step
# late, right after the next step's dV update: the GEMM overlaps that step's dS work, and the two
# consumer warpgroups meet at a dSᵀ buffer one step after writing it instead of within the step),
# "alt" (d = 64: one warpgroup per step, in turn, forms the partial over both warpgroups' 128 keys,
# half the TMA reductions; at d = 64 they are ~4x the d = 128 form's bytes per FLOP). "auto"
# takes what measured fastest on the H200 (results/sm90_bwd_order_*_a0cfad4_*.json and
# results/tune/sm90_bwd_order_*_a0cfad4_*.log, in one session): alt at d = 64 on 64-row steps
# (+10-14% over after; the default 128-row steps, ``ROWS_MODE``, take after), lag at d = 128
# without a mask (+5-9%; it loses 4-6% under causal masks), first at d = 128 under a mask
# (+4-5%). (Tried, session 19: "lag" with the partial issued after the
# step's dSᵀ store, d = 128 spills 256 -> 32 B, ran -6% at 2k and within 1% from 4k without a
# mask, results/bwd_order_lag-late_ebb00c7_*.json; not kept.)
DQ_ORDERS = ("after", "first", "lag", "alt")
# (fused, d = 64) query rows a dK/dV step: 64, or 128, FlashAttention-3's step at d <= 64: Sᵀ and
# dPᵀ as [64 keys, 128 rows] wgmmas (N = 128 where 64-row steps issue N = 64, a quarter less
# shared-memory traffic per FLOP for those GEMMs), dV's and dK's updates over 128 rows a GEMM,
# each warpgroup's dQ partial its half of the rows over both warpgroups' 128 keys (two 64 x 64
# reductions a 128-row step, as "alt"'s one a 64-row step), half the steps' barrier waits and
# row-stat loads. 194 KB of shared memory. The anchor this aims at: FA3-class d=64 backward 540
# TFLOP/s at 16k on this H200 (../shared/anchors). Measured against 64-row steps (session 21,
# cuDNN beside each run, results/bwd_regs_{base,ROWS128}_736b182_*.json): non-causal 2k-16k
# 404-447 -> 444-486 TFLOP/s (1.08-1.09x cuDNN; 0.94-1.02x on 64-row steps), causal 334-438
# -> 349-473 (1.07-1.12x). IOATTN_SM90_BWD_ROWS: "auto" (default: 128 where it applies, the
# fused form at d = 64), "64" or "128"
ROWS_MODE = os.environ.get("IOATTN_SM90_BWD_ROWS", "auto").lower()
# (d <= 128, outside the "lag" order) each query head's steps in three loops, the middle one (the
# tiles that need no mask) without the mask's code: 15-30% fewer instructions a step in the SASS.
# IOATTN_SM90_BWD_SEGMENTS: "auto" (default) at d = 64 without a causal mask or window, 1 / 0
# force it on / off (``segments``)
SEGMENTS = os.environ.get("IOATTN_SM90_BWD_SEGMENTS", "auto").lower()
# (the dK/dV kernels, every head dim) the rows' LSE and delta loaded by the producer warp into
# shared memory with each Q/dO stage and read by the consumers just before their use
# (FlashAttention-3's arrangement), instead of global loads held in registers from the step's
# start. In the sm90 SASS: the d=128 fused kernel's spills 224 -> 0 B (after / first order,
# non-causal), 396-416 -> 16-20 B (causal), 336 -> 320 (lag), its unmasked step 821 -> 528
# instructions (d=64: 709 -> 504). On the H200: d=64 +9-13%, d=128 +9-23%, d=256 +2-9%
# (results/sm90_bwd_rowstats{1,0}_ef679d0_*.json); the default, IOATTN_SM90_BWD_ROW_STATS=0 the
# global-load form
ROW_STATS = os.environ.get("IOATTN_SM90_BWD_ROW_STATS", "1").lower() in ("1", "true", "on")
# the dK/dV CTAs' key blocks (and the dQ kernel's query blocks) in grouped heaviest-first order
# under a causal / local mask (default; IOATTN_SM90_BWD_LPT=0 the old order; ``_key_block``,
# ``query_tile``, ``_order``): the old (block, head) grids run one head after another, heaviest
# block first, and end on the last heads' heavy blocks; simulated for the FA grid's causal
# shapes with one CTA a SM, 3-7% over the ideal at 2k-8k against 0.1-1.6% grouped. Timed
# (session 16): causal d=128 +4-13%, d=64 +1-3%, d=256 +3-5% (results/lpt{1,0}_*_b1d4228*);
# d=128 2k / 4k in alternated runs 383 / 388 and 457 / 458 against 373 / 372 and 433 / 426
# causal, 489 / 489 and 498 / 503 against 494 / 494 and 504 / 510 without a mask
# (results/tune/lpt_bwd128_*_a1337ee_*), so a maskless grid keeps the old order. Session 22, on
# 128-row d=64 steps: LPT off ran causal 2k-16k 1-3% below it (results/bwd_lpt0_94a9093_*); the
# group as a constexpr power of two (no spill reloads in the d=128 causal step loop by compile,
# 11 a step with it an argument) timed -2% to +2% (results/bwd_group_const{1,0}_94a9093_*), dropped
LPT = os.environ.get("IOATTN_SM90_BWD_LPT", "1").lower() in ("1", "true", "on")
DQ_ORDER = os.environ.get("IOATTN_SM90_BWD_DQ_ORDER", "auto").lower()
# (the dK/dV kernel at d = 64 / 128) dK and dV of each full 64-key half staged in the warpgroup's
# Q / dO stage and stored by TMA, instead of from the wgmma registers in 4-byte pieces: those
# took 4.2-4.8 us of a 76 us CTA at d = 128 non-causal 2k (1 us at d = 64), by %globaltimer
# stamps (benchmarks/timeline.py --kernel bwd, results/tune/bwd_timeline_*_c97fce0_*). Default on;
# IOATTN_SM90_BWD_TMA_STORE=0 the register stores
TMA_STORE = os.environ.get("IOATTN_SM90_BWD_TMA_STORE", "1").lower() in ("1", "true", "on")
# (the dK/dV kernels) Pᵀ's exponentials kept before the wait for dPᵀ, so they run while dPᵀ is on
# the tensor cores: in the sm90 SASS ptxas otherwise hoists that wait above 27-28 of a thread's
# 32 exponentials (d=64 alt, d=128 lag orders). They go in a branch of their own on the step's
# first row being in the sequence (always true: a step past it would have P = 0, as its else
# gives), whose block ends before the wait: ptxas schedules within blocks.
# IOATTN_SM90_BWD_EXP_EARLY=1 turns it on (off by default until measured on the H200)
EXP_EARLY = gl.constexpr(os.environ.get("IOATTN_SM90_BWD_EXP_EARLY", "0").lower()
                         in ("1", "true", "on"))
# Batched backward calls' launches kept for repeats (``launch.Bound``, ``_BOUND``), keyed by the
# op's signature as the forward's (``attn_bwd_sm90``'s bind_key): a repeat skips the launch
# rules, the descriptors' building and the launcher's per-call signature, and launches the
# preprocess, the dK/dV kernel and the dQ kernel (or the fused form's dQ conversion) with the
# call's addresses. The eager sm90 backward took 480-610 us of host time a call on the H100 machine
# (results/tune/host_graph_*_113e7bd_nvidia-h100_*.log). On by default since its GPU test and
# the whole GPU suite with it on passed on the H100 (results/tune/tests_counters_c0cc029_*.log,
# tests_gpu_counters1_bwdbind1_c0cc029_*.log) and the backward alone's host time fell from 274 to
# 172 us (fused) and 289 to 154 (two kernels) there (results/tune/host_overhead_c0cc029_*.json).
# IOATTN_SM90_BWD_BIND=0 turns it off
BIND = os.environ.get("IOATTN_SM90_BWD_BIND", "1").lower() not in ("0", "false", "off")


@gluon.jit
def _mask_scores(s, rows, cols, seqlen_q, seqlen_k, off, window_left, window_right,
                 HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    # rows / cols broadcast to s's shape (either orientation); rows past seqlen_q are masked too:
    # they belong to the next sequence in the packed views
    vis = (cols < seqlen_k) & (rows < seqlen_q)
    if HAS_RIGHT:
        vis = vis & (cols <= rows + off + window_right)
    if HAS_LEFT:
        vis = vis & (cols >= rows + off - window_left)
    return gl.where(vis, s, float("-inf"))


@gluon.jit
def _tile_needs_mask(m0, n0, seqlen_q, seqlen_k, off, window_left, window_right,
                     HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, KEYS: gl.constexpr = 128,
                     ROWS: gl.constexpr = 64):
    # whether a ROWS-row x KEYS-key tile at (m0, n0) has a masked pair (scalar test; the dQ
    # kernel's 64-key tiles use the default 128, conservatively)
    need = (m0 + ROWS > seqlen_q) | (n0 + KEYS > seqlen_k)
    if HAS_RIGHT:
        need = need | (n0 + KEYS - 1 > m0 + off + window_right)
    if HAS_LEFT:
        need = need | (n0 < m0 + ROWS - 1 + off - window_left)
    return need


@gluon.jit
def _softcap_p_grad(p, lse2, qk_scale_log2):
    """P (1 - t²) for dS = P (dP - delta) (1 - t²) under softcap, t the capped score's tanh,
    recovered from P itself: P = exp2(t · qk_scale_log2 - lse2), so t = (log2 P + lse2) /
    qk_scale_log2 (one MUFU lg2 a score; ``gl.log2`` compiled to a longer sequence and spilled
    more). Keeping 1 - t² from Sᵀ instead held another 64x64 fp32 tile across the wait for dPᵀ:
    the d=128 fused causal kernel spilled 348 B that way, 120 B this way (16 B without
    softcap). P = 0 (masked, or underflow) stays 0."""
    lg = gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [p], dtype=gl.float32,
                                   is_pure=True, pack=1)
    t = (lg + lse2) * (1.0 / qk_scale_log2)
    return gl.where(p > 0.0, p * (1.0 - t * t), 0.0)


@gluon.jit
def _lse_base2(lse):
    """A row's LSE (loaded with +inf past the sequence) for exp2: base 2, and +inf where it is
    -inf (fully masked rows), so that their P is exactly 0 instead of NaN."""
    return gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


# ----------------------------------------------------------------------------------- dK / dV
@gluon.jit
def _key_half(k_smem, i, FUSED_DQ: gl.constexpr):
    # the block's keys [64 i, 64 i + 64): one [128, d] buffer in the fused form (its dQ product
    # reads all 128 keys by column halves), two [64, d] tiles otherwise
    if FUSED_DQ:
        half = k_smem.slice(i * HALF, HALF, dim=0)
    else:
        half = k_smem.index(i)
    return half


@gluon.jit
def _dkdv_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar,
                   qdo_full, qdo_empty, fixed, q_start, k_row, kv_col, h0, lo_m, n_m, n_steps,
                   seqlen_q, n_keys, LSE, DELTA, ld_smem, lse_base, stride_lh,
                   STAGES: gl.constexpr, IS_VARLEN: gl.constexpr, FUSED_DQ: gl.constexpr,
                   KEY_TILES: gl.constexpr = 2, ROW_STATS: gl.constexpr = False):
    # KEY_TILES: 64-key K/V tiles per CTA (1: the d = 256 column-split kernel). ROW_STATS: each
    # stage also carries its rows' LSE (base 2, +inf for rows past the sequence and for fully
    # masked rows, so their P is 0) and delta in ld_smem[2 st], ld_smem[2 st + 1], stored by this
    # warp and announced by a second arrival on qdo_full[st]. A step's query rows: the stages'
    # (64, or 128 in the ROWS form, ``ROWS_MODE``)
    HEAD_D: gl.constexpr = box_cols(q_desc.block_type.shape)
    ROWS: gl.constexpr = q_smem.shape[1]
    ld_layout: gl.constexpr = gl.BlockedLayout([ROWS // 32], [32], [1], [0])  # over one warp
    has_work = n_steps > 0
    # K's box: HALF rows a copy, or (3D views of a padded head dim, fused form) the whole
    # [2 HALF, d] buffer in one copy: a 3D box cannot land in a row slice of a 128-byte swizzled
    # buffer (the slice's column blocks are not contiguous; ``tma_load`` asserts it)
    K_BOX: gl.constexpr = k_desc.block_type.shape[0]
    mbarrier.expect(kv_bar, (KEY_TILES * HALF // K_BOX) * k_desc.block_type.nbytes
                    + KEY_TILES * v_desc.block_type.nbytes, pred=has_work)
    for i in gl.static_range(KEY_TILES):
        if K_BOX == HALF:
            tma_load(k_desc, k_row + i * HALF, kv_col, kv_bar, _key_half(k_smem, i, FUSED_DQ),
                     pred=has_work)
        elif i == 0:
            tma_load(k_desc, k_row, kv_col, kv_bar, k_smem, pred=has_work)
        tma_load(v_desc, k_row + i * HALF, kv_col, kv_bar, v_smem.index(i), pred=has_work)
    if IS_VARLEN and FUSED_DQ:
        # keys past the last packed sequence (rows of no sequence, possibly NaN) would reach dQ
        # through dS·K and dP = dO·Vᵀ even with dS masked to 0: zero them (fixed[STAGES])
        if has_work & (n_keys < 2 * HALF):
            mbarrier.wait(kv_bar, 0)
            for i in gl.static_range(2):
                zero_tail_rows(_key_half(k_smem, i, FUSED_DQ), n_keys - i * HALF)
                zero_tail_rows(v_smem.index(i), n_keys - i * HALF)
            fence_async_shared()
            mbarrier.arrive(fixed.index(STAGES), count=1)
    fixes = 0  # per-stage phase bits of fixed[st]
    for t in range(n_steps):
        st = t % STAGES
        g = t // n_m
        row = q_start + lo_m + (t - g * n_m) * ROWS
        col = (h0 + g) * HEAD_D
        if ROW_STATS:  # loaded before the wait for the stage, so that it hides their latency
            rows = row - q_start + gl.arange(0, ROWS, layout=ld_layout)
            ok = rows < seqlen_q
            offs = lse_base + (h0 + g).to(gl.int64) * stride_lh + rows
            lse = gl.load(LSE + offs, mask=ok, other=float("inf"))
            delta = gl.load(DELTA + offs, mask=ok, other=0.0)
        mbarrier.wait(qdo_empty.index(st), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(qdo_full.index(st), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, row, col, qdo_full.index(st), q_smem.index(st))
        tma_load(do_desc, row, col, qdo_full.index(st), do_smem.index(st))
        if ROW_STATS:
            ld_smem.index(2 * st).store(_lse_base2(lse))
            ld_smem.index(2 * st + 1).store(delta)
            gl.thread_barrier()  # the warp's stores, before its one arrival
            mbarrier.arrive(qdo_full.index(st), count=1)
        if IS_VARLEN:
            # a query tile past the last packed sequence: zero those Q and dO rows (dSᵀ·Q and
            # dPᵀ = V·dOᵀ would carry 0 * NaN into dK and dV), then release the tile
            first = q_start + seqlen_q - row
            if first < ROWS:
                mbarrier.wait(qdo_full.index(st), (t // STAGES) & 1)
                zero_tail_rows(q_smem.index(st), first)
                zero_tail_rows(do_smem.index(st), first)
                fence_async_shared()
                mbarrier.arrive(fixed.index(st), count=1)
                fixes = fixes ^ (1 << st)


@gluon.jit
def _dq_partial(ds_all, ds_s, k, k_smem, ds_ready, t, WG: gl.constexpr, DQ_COLS: gl.constexpr,
                SPLIT_DQ: gl.constexpr, dq_layout: gl.constexpr, ALL_KEYS: gl.constexpr = False):
    """(fused) Issue step t's dQ partial of this warpgroup, dS·K: from d = 128 its half of the
    columns over both warpgroups' keys; with 128-row steps (ds_all [128 keys, 128 rows]) its
    half of the rows over both warpgroups' keys; ALL_KEYS ("alt", d = 64) the whole partial over
    both warpgroups' keys; those wait until both warpgroups have stored their dSᵀ (ds_ready).
    Else the full width over its own keys. Returns the wgmma's pending result."""
    BOTH: gl.constexpr = ds_all.shape[1] == 2 * HALF or SPLIT_DQ or ALL_KEYS  # both halves read
    if ds_all.shape[1] == 2 * HALF:
        a = ds_all.slice(WG * HALF, HALF, dim=1).permute((1, 0))
        b = k_smem
    elif SPLIT_DQ:
        a = ds_all.permute((1, 0))
        b = k_smem.slice(WG * DQ_COLS, DQ_COLS, dim=1)
    elif ALL_KEYS:
        a = ds_all.permute((1, 0))
        b = k_smem
    else:
        a = ds_s.permute((1, 0))
        b = k
    if BOTH:
        mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
    return warpgroup_mma(a, b, gl.zeros([HALF, DQ_COLS], gl.float32, layout=dq_layout),
                         use_acc=False, is_async=True)


@gluon.jit
def _hand_dq(dq, dq_smem, dq_full, dq_empty, j, WG: gl.constexpr):
    """(fused) Hand step j's dQ partial to the writer warp (``_dq_writer``), which issues its TMA
    reduction while this warpgroup goes on; the buffer is free once the writer has seen step
    j - 1's reduction read it."""
    mbarrier.wait(dq_empty.index(WG), (j & 1) ^ 1)
    dq_smem.index(WG).store(dq)
    fence_async_shared()
    gl.thread_barrier()  # the whole warpgroup's stores, before its one arrival
    mbarrier.arrive(dq_full.index(WG), count=1)


@gluon.jit
def _qdo_stage(t, q_smem, do_smem, qdo_full, fixed, fixes, m0, seqlen_q, STAGES: gl.constexpr,
               IS_VARLEN: gl.constexpr):
    """Step t's Q and dO tiles (query rows from m0) once in shared memory and, varlen, once the
    producer has zeroed their rows past the sequence; returns (q, do, fixes)."""
    st = t % STAGES
    mbarrier.wait(qdo_full.index(st), (t // STAGES) & 1)
    if IS_VARLEN:
        if m0 + q_smem.shape[1] > seqlen_q:  # rows past the end are being zeroed
            mbarrier.wait(fixed.index(st), (fixes >> st) & 1)
            fixes = fixes ^ (1 << st)
    return q_smem.index(st), do_smem.index(st), fixes


@gluon.jit
def _dkdv_scores(t, dv, k, v, q_smem, do_smem, qdo_full, fixed, fixes, LSE, DELTA, lse_base,
                 stride_lh, h0, ld_smem, lo_m, n_m, n0, seqlen_q, seqlen_k, window_left,
                 window_right, qk_scale_log2, softcap_scale, STAGES: gl.constexpr,
                 HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
                 MASK: gl.constexpr, ROW_STATS: gl.constexpr):
    """Step t's start in a dK/dV consumer warpgroup: its query rows' (64, or 128 in the ROWS
    form: the stages' rows) LSE and delta, Q and dO from the ring, Pᵀ (fp32) and dPᵀ for this
    warpgroup's 64 keys, then dV's update issued. MASK:
    0, the step's tile needs no mask (``_mask_segments``); 1, it is masked; 2, tested at run
    time. ROW_STATS: LSE and delta come from the stage's ld_smem rows (``_dkdv_producer``), read
    just before their use, instead of global loads held in registers from the step's start.
    Returns (stage, q, do, p, dp, delta, fixes, dV's pending update)."""
    ROWS: gl.constexpr = q_smem.shape[1]
    s_layout: gl.constexpr = wgmma_acc_layout(ROWS)
    key_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    off = seqlen_k - seqlen_q
    cols = n0 + gl.arange(0, HALF, layout=key_l)  # this warpgroup's keys (Sᵀ rows)
    s_zero = gl.zeros([HALF, ROWS], gl.float32, layout=s_layout)
    st = t % STAGES
    g = t // n_m
    m0 = lo_m + (t - g * n_m) * ROWS
    rows = m0 + gl.arange(0, ROWS, layout=row_l)
    if not ROW_STATS:
        lse_ptrs = LSE + lse_base + (h0 + g).to(gl.int64) * stride_lh + rows
        row_ok = rows < seqlen_q
        lse = gl.load(lse_ptrs, mask=row_ok, other=float("inf"))
        delta = gl.load(DELTA + lse_base + (h0 + g).to(gl.int64) * stride_lh + rows, mask=row_ok,
                        other=0.0)
        lse2 = _lse_base2(lse)
    q, do, fixes = _qdo_stage(t, q_smem, do_smem, qdo_full, fixed, fixes, m0, seqlen_q, STAGES,
                              IS_VARLEN)
    # Sᵀ and dPᵀ issued together; the exponentials run while dPᵀ is on the tensor cores, and
    # dSᵀ is formed while dV's update runs (wgmma groups retire in issue order)
    s_tok = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = softcap_tanh(warpgroup_mma_wait(1, deps=[s_tok]), softcap_scale)
    if MASK == 1:
        s = _mask_scores(s, rows[None, :], cols[:, None], seqlen_q, seqlen_k, off, window_left,
                         window_right, HAS_LEFT, HAS_RIGHT)
    elif MASK == 2:
        if _tile_needs_mask(m0, n0, seqlen_q, seqlen_k, off, window_left, window_right,
                            HAS_LEFT, HAS_RIGHT, HALF, ROWS):
            s = _mask_scores(s, rows[None, :], cols[:, None], seqlen_q, seqlen_k, off,
                             window_left, window_right, HAS_LEFT, HAS_RIGHT)
    if ROW_STATS:  # the rows' LSE (base 2) and delta from shared memory, just before each use
        lse2 = ld_smem.index(2 * st).load(row_l)
    if EXP_EARLY:
        if m0 < seqlen_q:  # always: a block boundary that keeps the wait for dPᵀ after them
            p = gl.exp2(s * qk_scale_log2 - lse2[None, :])
        else:
            p = s_zero
    else:
        p = gl.exp2(s * qk_scale_log2 - lse2[None, :])
    dp = warpgroup_mma_wait(0, deps=[dp_tok])
    if ROW_STATS:
        delta = ld_smem.index(2 * st + 1).load(row_l)
        # every warp's reads of the stage's rows before the warpgroup's one qdo_empty arrival
        # (some orders have no barrier between them otherwise)
        gl.thread_barrier()
    op_layout: gl.constexpr = wgmma_a_operand(wgmma_acc_layout(q_smem.shape[2]))
    dv_tok = warpgroup_mma(gl.convert_layout(p.to(q_smem.dtype), op_layout), do, dv,
                           is_async=True)
    if softcap_scale is not None:  # from here p only forms dS: it carries tanh's derivative
        p = _softcap_p_grad(p, lse2[None, :], qk_scale_log2)
    return st, q, do, p, dp, delta, fixes, dv_tok


@gluon.jit
def _dkdv_lag_step(t, dv, dk, fixes, k, v, k_smem, q_smem, do_smem, ds_smem, dq_smem, qdo_full,
                   qdo_empty, fixed, ds_ready, ds_empty, dq_full, dq_empty, LSE, DELTA, lse_base,
                   stride_lh, h0, ld_smem, lo_m, n_m, n0, q_start, seqlen_q, seqlen_k, window_left,
                   window_right, qk_scale_log2,
                   softcap_scale, sm_scale, WG: gl.constexpr, STAGES: gl.constexpr,
                   HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
                   HAS_PREV: gl.constexpr, MASK: gl.constexpr, ROW_STATS: gl.constexpr):
    """(fused, DQ_LAG) Step t with step t - 1's dQ partial (HAS_PREV) issued right after this
    step's dV update: the GEMM overlaps this step's dS, and the two warpgroups meet at a dSᵀ
    buffer one step after writing it instead of within the step. Returns (dv, dk, fixes)."""
    dtype: gl.constexpr = q_smem.dtype
    DQ_COLS: gl.constexpr = dq_smem.shape[2]
    SPLIT_DQ: gl.constexpr = DQ_COLS < q_smem.shape[2]
    dq_layout: gl.constexpr = wgmma_acc_layout(DQ_COLS)
    st, q, do, p, dp, delta, fixes, dv_tok = _dkdv_scores(
        t, dv, k, v, q_smem, do_smem, qdo_full, fixed, fixes, LSE, DELTA, lse_base, stride_lh,
        h0, ld_smem, lo_m, n_m, n0, seqlen_q, seqlen_k, window_left, window_right, qk_scale_log2,
        softcap_scale,
        STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN, MASK, ROW_STATS)
    if HAS_PREV:
        prev = ds_smem.index((t - 1) % 2)
        dq_tok = _dq_partial(prev, prev.slice(WG * HALF, HALF, dim=0), k, k_smem, ds_ready, t - 1,
                             WG, DQ_COLS, SPLIT_DQ, dq_layout)
    ds = p * (dp - delta[None, :])
    ds_all = ds_smem.index(t % 2)
    ds_s = ds_all.slice(WG * HALF, HALF, dim=0)
    if SPLIT_DQ:
        if t >= 2:  # both warpgroups' dQ GEMMs of step t - 2 have read this buffer
            mbarrier.wait(ds_empty.index(t % 2), ((t // 2) - 1) & 1)
    ds_s.store((ds * sm_scale).to(dtype))
    fence_async_shared()
    if SPLIT_DQ:
        gl.thread_barrier()  # the whole warpgroup's stores, before its one arrival
        mbarrier.arrive(ds_ready.index(t % 2), count=1)
    dk_tok = warpgroup_mma(ds_s, q, dk, is_async=True)
    if HAS_PREV:
        dv, dq = warpgroup_mma_wait(1, deps=[dv_tok, dq_tok])
        if SPLIT_DQ:
            mbarrier.arrive(ds_empty.index((t - 1) % 2), count=1)
        _hand_dq(dq, dq_smem, dq_full, dq_empty, t - 1, WG)
        dk = warpgroup_mma_wait(0, deps=[dk_tok])
    else:
        dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
    mbarrier.arrive(qdo_empty.index(st), count=1)
    return dv, dk, fixes


@gluon.jit
def _mask_segments(lo_m, n_m, n0, seqlen_q, seqlen_k, window_left, window_right,
                   HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, ROWS: gl.constexpr = 64):
    """(a, b), a <= b: of a head's query tiles lo_m + ROWS i (i < n_m) against the 64 keys from
    n0, those with a <= i < b need no mask (``_tile_needs_mask`` with 64 keys is false for them):
    a causal / right-window mask reaches the first tiles, a left window the last ones, the
    sequence's end the last tile (rows) or every tile (keys)."""
    off = seqlen_k - seqlen_q
    a = n_m * 0
    b = n_m
    if lo_m + n_m * ROWS > seqlen_q:
        b = n_m - 1
    if HAS_RIGHT:  # masked while m0 < n0 + 63 - off - window_right
        a = gl.minimum(gl.maximum(gl.cdiv(n0 + HALF - 1 - off - window_right - lo_m, ROWS), 0),
                       n_m)
    if HAS_LEFT:  # masked once m0 > n0 - (ROWS - 1) - off + window_left
        b = gl.minimum(b, gl.maximum(floor_div(n0 - ROWS + 1 - off + window_left - lo_m, ROWS)
                                     + 1, 0))
    if n0 + HALF > seqlen_k:
        a = n_m
    return a, gl.maximum(a, b)


@gluon.jit
def _dkdv_step(t, dv, dk, fixes, k, v, k_smem, q_smem, do_smem, ds_smem, dq_smem, qdo_full,
               qdo_empty, fixed, ds_ready, dq_full, dq_empty, LSE, DELTA, lse_base, stride_lh, h0,
               ld_smem, lo_m, n_m, n0, seqlen_q, seqlen_k, window_left, window_right, qk_scale_log2,
               softcap_scale,
               sm_scale, WG: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
               HAS_RIGHT: gl.constexpr, FUSED_DQ: gl.constexpr, IS_VARLEN: gl.constexpr,
               DQ_FIRST: gl.constexpr, DQ_ALT: gl.constexpr, MASK: gl.constexpr,
               ROW_STATS: gl.constexpr):
    """Step t of a dK/dV consumer warpgroup outside DQ_LAG (MASK as ``_dkdv_scores``). Returns
    (dv, dk, fixes)."""
    HEAD_D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    DQ_COLS: gl.constexpr = dq_smem.shape[2]
    SPLIT_DQ: gl.constexpr = DQ_COLS < HEAD_D
    dq_layout: gl.constexpr = wgmma_acc_layout(DQ_COLS)
    st, q, do, p, dp, delta, fixes, dv_tok = _dkdv_scores(
        t, dv, k, v, q_smem, do_smem, qdo_full, fixed, fixes, LSE, DELTA, lse_base, stride_lh,
        h0, ld_smem, lo_m, n_m, n0, seqlen_q, seqlen_k, window_left, window_right, qk_scale_log2,
        softcap_scale,
        STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN, MASK, ROW_STATS)
    ds = p * (dp - delta[None, :])
    if FUSED_DQ:
        # dSᵀ (scaled, so dK and dQ come out scaled) through shared memory: this
        # warpgroup's 64 keys of the step's [128 keys, 64 rows] buffer (two, alternating
        # by step). It is the A operand of dK += dSᵀ·Q; once both warpgroups have written
        # theirs (ds_ready), each forms half of the columns of the step's dQ partial dS·K
        # over all 128 keys and adds it to the fp32 dQ buffer with one TMA reduction: one
        # 64 x d partial per step leaves the CTA, not one per warpgroup (rows past the
        # sequence get dS = 0) (d = 64: a half would cut the 128-byte swizzle rows, so
        # each warpgroup forms the full-width partial over its own keys; with 128-row
        # steps, [128 keys, 128 rows] buffers, each forms the full width for its half of
        # the rows over all 128 keys)
        ds_all = ds_smem.index(t % 2)
        ds_s = ds_all.slice(WG * HALF, HALF, dim=0)
        ds_s.store((ds * sm_scale).to(dtype))
        fence_async_shared()
        if SPLIT_DQ or DQ_ALT or q_smem.shape[1] == 2 * HALF:
            gl.thread_barrier()  # the whole warpgroup's stores, before its one arrival
            mbarrier.arrive(ds_ready.index(t % 2), count=1)
        if DQ_ALT:
            # (d = 64) one warpgroup per step, in turn, forms the whole dQ partial over
            # both warpgroups' 128 keys: one 64 x 64 reduction a step instead of two
            dk_tok = warpgroup_mma(ds_s, q, dk, is_async=True)
            if t % 2 == WG:
                dq_tok = _dq_partial(ds_all, ds_s, k, k_smem, ds_ready, t, WG, DQ_COLS,
                                     SPLIT_DQ, dq_layout, True)
                dv, dk, dq = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok])
                mbarrier.arrive(qdo_empty.index(st), count=1)
                _hand_dq(dq, dq_smem, dq_full, dq_empty, t // 2, WG)
            else:
                dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
                mbarrier.arrive(qdo_empty.index(st), count=1)
        elif DQ_FIRST:
            # dQ's partial before dK's update: dK's GEMM then runs while the partial is
            # handed to the writer (wgmma groups retire in issue order)
            dq_tok = _dq_partial(ds_all, ds_s, k, k_smem, ds_ready, t, WG, DQ_COLS,
                                 SPLIT_DQ, dq_layout)
            dk_tok = warpgroup_mma(ds_s, q, dk, is_async=True)
            dv, dq = warpgroup_mma_wait(1, deps=[dv_tok, dq_tok])
        else:
            dk_tok = warpgroup_mma(ds_s, q, dk, is_async=True)
            dq_tok = _dq_partial(ds_all, ds_s, k, k_smem, ds_ready, t, WG, DQ_COLS,
                                 SPLIT_DQ, dq_layout)
            dv, dk, dq = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok])
            mbarrier.arrive(qdo_empty.index(st), count=1)
        if not DQ_ALT:
            _hand_dq(dq, dq_smem, dq_full, dq_empty, t, WG)
        if DQ_FIRST and not DQ_ALT:
            dk = warpgroup_mma_wait(0, deps=[dk_tok])
            mbarrier.arrive(qdo_empty.index(st), count=1)
    else:
        op_layout: gl.constexpr = wgmma_a_operand(wgmma_acc_layout(HEAD_D))
        dk_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), q, dk,
                               is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
        mbarrier.arrive(qdo_empty.index(st), count=1)
    return dv, dk, fixes


@gluon.jit
def _dkdv_consumer(DK, DV, dk_desc, dv_desc, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, ds_smem,
                   dq_smem, kv_bar, qdo_full, qdo_empty, fixed, ds_ready, ds_empty, dq_full,
                   dq_empty, dk_off, dv_off, k_row, kv_col, stride_dkn, stride_dvn, lse_base,
                   stride_lh, h0, ld_smem, lo_m, n_m, n_steps, start_n, q_start, seqlen_q,
                   seqlen_k, window_left, window_right, qk_scale_log2, softcap_scale, sm_scale,
                   WG: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                   HAS_RIGHT: gl.constexpr, FUSED_DQ: gl.constexpr, IS_VARLEN: gl.constexpr,
                   DQ_FIRST: gl.constexpr, DQ_LAG: gl.constexpr, DQ_ALT: gl.constexpr,
                   SEGMENTS: gl.constexpr, ROW_STATS: gl.constexpr, K_COLS: gl.constexpr,
                   V_COLS: gl.constexpr, TMA_STORE: gl.constexpr):
    # TMA_STORE: dK / dV of a full 64-key half staged in this warpgroup's Q / dO stage and
    # stored by TMA (rows k_row + WG * 64 of dk_desc / dv_desc, column kv_col)
    HEAD_D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    # dK / dV: [64 keys, d] (Sᵀ / dPᵀ: [64 keys, 64 query rows], ``_dkdv_scores``)
    a_layout: gl.constexpr = wgmma_acc_layout(HEAD_D)
    # (fused) dQ's columns per warpgroup: half of them from d = 128 (``_dq_cols``)
    DQ_COLS: gl.constexpr = dq_smem.shape[2]
    SPLIT_DQ: gl.constexpr = DQ_COLS < HEAD_D
    dq_layout: gl.constexpr = wgmma_acc_layout(DQ_COLS)
    op_layout: gl.constexpr = wgmma_a_operand(a_layout)

    k = _key_half(k_smem, WG, FUSED_DQ)
    v = v_smem.index(WG)
    n0 = start_n + WG * HALF
    dk = gl.zeros([HALF, HEAD_D], gl.float32, layout=a_layout)
    dv = gl.zeros([HALF, HEAD_D], gl.float32, layout=a_layout)
    if n_steps > 0:
        mbarrier.wait(kv_bar, 0)
        if IS_VARLEN and FUSED_DQ:
            if seqlen_k - start_n < 2 * HALF:  # the producer zeroes keys past the end
                mbarrier.wait(fixed.index(STAGES), 0)
    fixes = n_steps * 0  # (varlen) parity per stage of the zeroed-rows barriers
    if FUSED_DQ and DQ_LAG:
        if n_steps > 0:  # the first step (no partial before it) peeled
            dv, dk, fixes = _dkdv_lag_step(
                0, dv, dk, fixes, k, v, k_smem, q_smem, do_smem, ds_smem, dq_smem, qdo_full,
                qdo_empty, fixed, ds_ready, ds_empty, dq_full, dq_empty, LSE, DELTA, lse_base,
                stride_lh, h0, ld_smem, lo_m, n_m, n0, q_start, seqlen_q, seqlen_k, window_left,
                window_right, qk_scale_log2,
                softcap_scale, sm_scale, WG, STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN,
                False, 2, ROW_STATS)
            for t in range(1, n_steps):
                dv, dk, fixes = _dkdv_lag_step(
                    t, dv, dk, fixes, k, v, k_smem, q_smem, do_smem, ds_smem, dq_smem, qdo_full,
                    qdo_empty, fixed, ds_ready, ds_empty, dq_full, dq_empty, LSE, DELTA, lse_base,
                    stride_lh, h0, ld_smem, lo_m, n_m, n0, q_start, seqlen_q, seqlen_k, window_left,
                    window_right, qk_scale_log2,
                    softcap_scale, sm_scale, WG, STAGES, HAS_LEFT, HAS_RIGHT,
                    IS_VARLEN, True, 2, ROW_STATS)
            # the last step's dQ partial
            last = n_steps - 1
            prev = ds_smem.index(last % 2)
            dq_tok = _dq_partial(prev, prev.slice(WG * HALF, HALF, dim=0), k, k_smem, ds_ready,
                                 last, WG, DQ_COLS, SPLIT_DQ, dq_layout)
            dq = warpgroup_mma_wait(0, deps=[dq_tok])
            _hand_dq(dq, dq_smem, dq_full, dq_empty, last, WG)
    elif SEGMENTS:
        # each query head's steps in three runs: the tiles before a and from b on masked, those
        # between without the mask's code (``_mask_segments``)
        a, b = _mask_segments(lo_m, n_m, n0, seqlen_q, seqlen_k, window_left, window_right,
                              HAS_LEFT, HAS_RIGHT, q_smem.shape[1])
        for g in range(n_steps // gl.maximum(n_m, 1)):
            for run in gl.static_range(3):
                lo = g * n_m + (0 if run == 0 else (a if run == 1 else b))
                hi = g * n_m + (a if run == 0 else (b if run == 1 else n_m))
                for t in range(lo, hi):
                    dv, dk, fixes = _dkdv_step(
                        t, dv, dk, fixes, k, v, k_smem, q_smem, do_smem, ds_smem, dq_smem, qdo_full,
                        qdo_empty, fixed, ds_ready, dq_full, dq_empty, LSE, DELTA, lse_base,
                        stride_lh, h0, ld_smem, lo_m, n_m, n0, seqlen_q, seqlen_k, window_left, window_right,
                        qk_scale_log2,
                        softcap_scale, sm_scale, WG, STAGES, HAS_LEFT, HAS_RIGHT, FUSED_DQ,
                        IS_VARLEN, DQ_FIRST, DQ_ALT, 0 if run == 1 else 1, ROW_STATS)
    else:  # one loop, each tile's mask tested at run time
        for t in range(n_steps):
            dv, dk, fixes = _dkdv_step(
                t, dv, dk, fixes, k, v, k_smem, q_smem, do_smem, ds_smem, dq_smem, qdo_full,
                qdo_empty, fixed, ds_ready, dq_full, dq_empty, LSE, DELTA, lse_base, stride_lh, h0, ld_smem,
                lo_m, n_m, n0, seqlen_q, seqlen_k, window_left, window_right, qk_scale_log2,
                softcap_scale,
                sm_scale, WG, STAGES, HAS_LEFT, HAS_RIGHT, FUSED_DQ, IS_VARLEN, DQ_FIRST, DQ_ALT, 2,
                ROW_STATS)

    d_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, a_layout))
    keys = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, a_layout))
    ok = (keys < seqlen_k)[:, None]
    if not FUSED_DQ:
        dk = dk * sm_scale
    if TMA_STORE and n0 + HALF <= seqlen_k:
        # stage WG of the Q / dO ring is free once both warpgroups have released its last
        # step (nothing is loaded after the last step): dK, dV there, then one TMA store each
        # (from registers, the wgmma layout's 4-byte pieces took ~4 us a CTA at d = 128)
        uses = (n_steps - WG + STAGES - 1) // STAGES
        if uses > 0:
            mbarrier.wait(qdo_empty.index(WG), (uses - 1) & 1)
        q_stage = q_smem.index(WG)
        do_stage = do_smem.index(WG)
        if q_smem.shape[1] != HALF:  # (128-row stages) the first 64 rows
            q_stage = q_stage.slice(0, HALF, dim=0)
            do_stage = do_stage.slice(0, HALF, dim=0)
        stage_tma_store(dk_desc, k_row + WG * HALF, kv_col, q_stage, dk.to(dtype))
        stage_tma_store(dv_desc, k_row + WG * HALF, kv_col, do_stage, dv.to(dtype))
        tma.store_wait(0)
    else:
        store_cols(DK + dk_off + keys[:, None].to(gl.int64) * stride_dkn + d_cols[None, :],
                   dk.to(dtype), ok, d_cols, K_COLS)
        store_cols(DV + dv_off + keys[:, None].to(gl.int64) * stride_dvn + d_cols[None, :],
                   dv.to(dtype), ok, d_cols, V_COLS)


@gluon.jit
def _dq_writer(dqa_desc, dq_smem, dq_full, dq_empty, q_start, h0, lo_m, n_m, n_steps,
               HEAD_D: gl.constexpr, DQ_ALT: gl.constexpr, ROWS: gl.constexpr = 64):
    """(fused) The dQ writer warp, FA3's arrangement: per step, each consumer warpgroup's fp32
    partial (its half of the columns from d = 128, its half of the rows in 128-row steps
    (ROWS), else the full width over its own keys) goes from shared memory to the dQ
    accumulator by an asynchronous TMA reduction; the writer waits only for the reductions to
    have read their buffers before handing them back. DQ_ALT: one partial a step, from
    warpgroup t % 2."""
    DQ_COLS: gl.constexpr = dq_smem.shape[2]
    SPLIT_DQ: gl.constexpr = DQ_COLS < HEAD_D
    if DQ_ALT:
        for t in range(n_steps):
            g = t // n_m
            row = q_start + lo_m + (t - g * n_m) * HALF
            wg = t % 2
            mbarrier.wait(dq_full.index(wg), (t // 2) & 1)
            tma_reduce_add(dqa_desc, [row, (h0 + g) * HEAD_D], dq_smem.index(wg))
            tma.store_wait(0)
            mbarrier.arrive(dq_empty.index(wg), count=1)
    else:
        for t in range(n_steps):
            g = t // n_m
            row = q_start + lo_m + (t - g * n_m) * ROWS
            col = (h0 + g) * HEAD_D
            for wg in gl.static_range(2):
                mbarrier.wait(dq_full.index(wg), t & 1)
                if SPLIT_DQ:
                    tma_reduce_add(dqa_desc, [row, col + wg * DQ_COLS], dq_smem.index(wg))
                elif ROWS != HALF:
                    tma_reduce_add(dqa_desc, [row + wg * HALF, col], dq_smem.index(wg))
                else:
                    tma_reduce_add(dqa_desc, [row, col], dq_smem.index(wg))
            tma.store_wait(0)
            mbarrier.arrive(dq_empty.index(0), count=1)
            mbarrier.arrive(dq_empty.index(1), count=1)


@gluon.jit
def _key_block(CU_Q, CU_K, n_heads_k, kv_group, seqlen_q_fixed, seqlen_k_fixed, window_left,
               window_right, stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_lb,
               BLOCK_N: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr,
               HAS_RIGHT: gl.constexpr, head_group=1, ROWS: gl.constexpr = 64):
    """A dK/dV CTA's key block: (KV head, the sequence's bounds, its first key, the first query
    row of its ROWS-row steps, the steps over the GQA group's query heads, the group's first
    query head, and the dK / dV / LSE offsets). head_group != 1: the (key blocks, batch * KV heads)
    grid's CTAs, in launch order, take the blocks in grouped heaviest-first order
    (``sm90_common.grouped_order``, ``LPT``); 1: block = program_id(0), one head after another."""
    if head_group == 1:
        pid_bh = gl.program_id(1)
        block = gl.program_id(0)
    else:
        block, pid_bh = grouped_order(gl.program_id(0) + gl.program_id(1) * gl.num_programs(0),
                                      gl.num_programs(0), head_group)
    off_b = pid_bh // n_heads_k
    off_hk = pid_bh % n_heads_k
    q_start, seqlen_q, k_start, seqlen_k, lse_start = seq_bounds(CU_Q, CU_K, off_b, seqlen_q_fixed,
                                                                 seqlen_k_fixed, IS_VARLEN)
    start_n = block * BLOCK_N
    lo_m, n_m = query_tiles(start_n, BLOCK_N, seqlen_q, seqlen_k, window_left, window_right, ROWS,
                            HAS_LEFT, HAS_RIGHT)
    dk_off = k_start.to(gl.int64) * stride_dkn + off_hk.to(gl.int64) * stride_dkh
    dv_off = k_start.to(gl.int64) * stride_dvn + off_hk.to(gl.int64) * stride_dvh
    lse_base = off_b.to(gl.int64) * stride_lb + lse_start
    return (off_hk, q_start, seqlen_q, k_start, seqlen_k, start_n, lo_m, n_m * kv_group,
            off_hk * kv_group, dk_off, dv_off, lse_base)


@gluon.jit
def _bwd_dkdv_sm90(q_desc, do_desc, k_desc, v_desc, dqa_desc, dk_desc, dv_desc, DK, DV, LSE, DELTA,
                   CU_Q, CU_K,
                   stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_lb, stride_lh,
                   n_heads_k, kv_group, seqlen_q_fixed, seqlen_k_fixed,
                   sm_scale, qk_scale_log2, window_left, window_right,
                   IS_VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                   STAGES: gl.constexpr, FUSED_DQ: gl.constexpr, CONSUMER_REGS_: gl.constexpr,
                   PRODUCER_REGS_: gl.constexpr, DQ_FIRST: gl.constexpr = False,
                   DQ_LAG: gl.constexpr = False, DQ_ALT: gl.constexpr = False,
                   SEGMENTS: gl.constexpr = False, ROW_STATS: gl.constexpr = False,
                   softcap_scale=None, K_COLS: gl.constexpr = 0, V_COLS: gl.constexpr = 0,
                   head_group=1, TMA_STORE: gl.constexpr = False):
    # K_COLS / V_COLS: dK's and dV's own head dims where the tiles are zero-padded past them
    # (head dims 96 / 192 read in place, ``rows_descriptor(pad_to=...)``); 0: the tiles' width;
    # head_group: the blocks' order (``_key_block``); TMA_STORE: dK / dV of full
    # key halves by TMA through dk_desc / dv_desc (``_dkdv_consumer``). A step's query rows:
    # Q's box rows, 64, or 128 (the ROWS form, ``ROWS_MODE``: fused, d = 64, dQ after or first)
    HEAD_D: gl.constexpr = box_cols(q_desc.block_type.shape)
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    gl.static_assert(ROWS == HALF or (ROWS == 2 * HALF and FUSED_DQ and HEAD_D == HALF
                                      and not DQ_LAG and not DQ_ALT),
                     "128-row steps: fused, d = 64, dQ after or first")
    (off_hk, q_start, seqlen_q, k_start, seqlen_k, start_n, lo_m, n_steps, h0, dk_off, dv_off,
     lse_base) = _key_block(CU_Q, CU_K, n_heads_k, kv_group, seqlen_q_fixed, seqlen_k_fixed,
                            window_left, window_right, stride_dkn, stride_dkh, stride_dvn,
                            stride_dvh, stride_lb, 2 * HALF, IS_VARLEN, HAS_LEFT, HAS_RIGHT,
                            head_group, ROWS)
    n_m = n_steps // kv_group
    if start_n >= seqlen_k:
        return

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, ROWS, HEAD_D],
                                       tile_layout(q_desc.layout))
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, ROWS, HEAD_D],
                                        tile_layout(do_desc.layout))
    if FUSED_DQ:
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2 * HALF, HEAD_D],
                                           tile_layout(k_desc.layout))
    else:
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, HALF, HEAD_D],
                                           tile_layout(k_desc.layout))
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, HALF, HEAD_D],
                                       tile_layout(v_desc.layout))
    if FUSED_DQ:
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * HALF, ROWS],
                                                                       q_desc.dtype)
        ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, 2 * HALF, ROWS], ds_layout)
        # one fp32 dQ partial per consumer warpgroup, read by the writer's TMA reductions
        dq_smem = gl.allocate_shared_memory(dqa_desc.dtype, [2, HALF, dqa_desc.block_type.shape[1]],
                                            dqa_desc.layout)
    else:
        ds_smem = k_smem  # unused
        dq_smem = k_smem  # unused
    kv_bar = barriers(1, 1)
    fixed = barriers(STAGES + 1, 1)  # zeroed tail rows: per Q/dO stage, then K/V
    if FUSED_DQ:
        # a step's dSᵀ buffer holds both warpgroups' keys. Its reuse two steps on needs no
        # barrier of its own outside DQ_LAG, whatever the ring depth. Split dQ: a warpgroup
        # writing its half of buffer t % 2 at step t + 2 has waited on ds_ready of step t + 1,
        # which the other warpgroup completes only after retiring its step-t GEMMs (its dQ
        # GEMM read this half). DQ_ALT: only warpgroup t % 2's partial, retired within step t,
        # reads the other warpgroup's half, and that other warpgroup forms step t + 1's partial,
        # so it waits on ds_ready of step t + 1 before its step t + 2
        ds_ready = barriers(2, 2)
        ds_empty = barriers(2, 2)  # (DQ_LAG) both warpgroups' dQ GEMMs have read it
        dq_full = barriers(2, 1)  # per warpgroup: its partial is in dq_smem
        dq_empty = barriers(2, 1)  # per warpgroup: the writer's reduction has read it
    else:
        ds_ready = fixed  # unused
        ds_empty = fixed
        dq_full = fixed
        dq_empty = fixed
    # (ROW_STATS) a second arrival per phase: the producer's stores of the rows' LSE / delta
    qdo_full = barriers(STAGES, 2 if ROW_STATS else 1)
    qdo_empty = barriers(STAGES, 2)  # one arrive per consumer warpgroup
    if ROW_STATS:  # per stage: its rows' LSE (base 2) and delta (``_dkdv_producer``)
        ld_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, ROWS],
                                            gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        ld_smem = fixed  # unused
    fence_async_shared()

    # (the partition lists are literal: Gluon loses constexpr-ness through tuple arguments)
    if FUSED_DQ:
        gl.warp_specialize([
            (_dkdv_consumer, (DK, DV, dk_desc, dv_desc, LSE, DELTA, q_smem, do_smem, k_smem,
                              v_smem, ds_smem, dq_smem, kv_bar.index(0), qdo_full, qdo_empty, fixed,
                              ds_ready, ds_empty, dq_full, dq_empty, dk_off, dv_off,
                              k_start + start_n, off_hk * HEAD_D, stride_dkn, stride_dvn, lse_base, stride_lh, h0, ld_smem, lo_m, n_m, n_steps,
                              start_n, q_start, seqlen_q, seqlen_k, window_left, window_right,
                              qk_scale_log2, softcap_scale, sm_scale,
                              0, STAGES, HAS_LEFT, HAS_RIGHT, FUSED_DQ, IS_VARLEN, DQ_FIRST, DQ_LAG, DQ_ALT, SEGMENTS,
                              ROW_STATS, K_COLS, V_COLS, TMA_STORE)),
            (_dkdv_consumer, (DK, DV, dk_desc, dv_desc, LSE, DELTA, q_smem, do_smem, k_smem,
                              v_smem, ds_smem, dq_smem, kv_bar.index(0), qdo_full, qdo_empty, fixed,
                              ds_ready, ds_empty, dq_full, dq_empty, dk_off, dv_off,
                              k_start + start_n, off_hk * HEAD_D, stride_dkn, stride_dvn, lse_base, stride_lh, h0, ld_smem, lo_m, n_m, n_steps,
                              start_n, q_start, seqlen_q, seqlen_k, window_left, window_right,
                              qk_scale_log2, softcap_scale, sm_scale,
                              1, STAGES, HAS_LEFT, HAS_RIGHT, FUSED_DQ, IS_VARLEN, DQ_FIRST, DQ_LAG, DQ_ALT, SEGMENTS,
                              ROW_STATS, K_COLS, V_COLS, TMA_STORE)),
            (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                              kv_bar.index(0), qdo_full, qdo_empty, fixed, q_start, k_start + start_n,
                              off_hk * HEAD_D, h0, lo_m, n_m, n_steps, seqlen_q, seqlen_k - start_n,
                              LSE, DELTA, ld_smem, lse_base, stride_lh, STAGES, IS_VARLEN, FUSED_DQ, 2,
                              ROW_STATS)),
            (_dq_writer, (dqa_desc, dq_smem, dq_full, dq_empty, q_start, h0, lo_m, n_m, n_steps,
                          HEAD_D, DQ_ALT, ROWS)),
        ], [4, 1, 1], [CONSUMER_REGS_, PRODUCER_REGS_, PRODUCER_REGS_])
    else:
        gl.warp_specialize([
            (_dkdv_consumer, (DK, DV, dk_desc, dv_desc, LSE, DELTA, q_smem, do_smem, k_smem,
                              v_smem, ds_smem, dq_smem, kv_bar.index(0), qdo_full, qdo_empty, fixed,
                              ds_ready, ds_empty, dq_full, dq_empty, dk_off, dv_off,
                              k_start + start_n, off_hk * HEAD_D, stride_dkn, stride_dvn, lse_base, stride_lh, h0, ld_smem, lo_m, n_m, n_steps,
                              start_n, q_start, seqlen_q, seqlen_k, window_left, window_right,
                              qk_scale_log2, softcap_scale, sm_scale,
                              0, STAGES, HAS_LEFT, HAS_RIGHT, FUSED_DQ, IS_VARLEN, DQ_FIRST, DQ_LAG, DQ_ALT, SEGMENTS,
                              ROW_STATS, K_COLS, V_COLS, TMA_STORE)),
            (_dkdv_consumer, (DK, DV, dk_desc, dv_desc, LSE, DELTA, q_smem, do_smem, k_smem,
                              v_smem, ds_smem, dq_smem, kv_bar.index(0), qdo_full, qdo_empty, fixed,
                              ds_ready, ds_empty, dq_full, dq_empty, dk_off, dv_off,
                              k_start + start_n, off_hk * HEAD_D, stride_dkn, stride_dvn, lse_base, stride_lh, h0, ld_smem, lo_m, n_m, n_steps,
                              start_n, q_start, seqlen_q, seqlen_k, window_left, window_right,
                              qk_scale_log2, softcap_scale, sm_scale,
                              1, STAGES, HAS_LEFT, HAS_RIGHT, FUSED_DQ, IS_VARLEN, DQ_FIRST, DQ_LAG, DQ_ALT, SEGMENTS,
                              ROW_STATS, K_COLS, V_COLS, TMA_STORE)),
            (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                              kv_bar.index(0), qdo_full, qdo_empty, fixed, q_start, k_start + start_n,
                              off_hk * HEAD_D, h0, lo_m, n_m, n_steps, seqlen_q, seqlen_k - start_n,
                              LSE, DELTA, ld_smem, lse_base, stride_lh, STAGES, IS_VARLEN, FUSED_DQ, 2,
                              ROW_STATS)),
        ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])

    invalidate(kv_bar, 1)
    invalidate(fixed, STAGES + 1)
    if FUSED_DQ:
        invalidate(ds_ready, 2)
        invalidate(ds_empty, 2)
        invalidate(dq_full, 2)
        invalidate(dq_empty, 2)
    invalidate(qdo_full, STAGES)
    invalidate(qdo_empty, STAGES)


# --------------------------------------------------------------------- dK / dV at d = 256
@gluon.jit
def _dkdv_cols_consumer(DK, DV, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem,
                        kv_bar, qdo_full, qdo_empty, fixed, p_ready, ds_ready, dk_off, dv_off,
                        stride_dkn, stride_dvn, lse_base, stride_lh, h0, lo_m, n_m, n_steps,
                        start_n, q_start, seqlen_q, seqlen_k, window_left, window_right,
                        qk_scale_log2, sm_scale, ld_smem, WG: gl.constexpr, STAGES: gl.constexpr,
                        HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                        IS_VARLEN: gl.constexpr, ROW_STATS: gl.constexpr, K_COLS: gl.constexpr,
                        V_COLS: gl.constexpr, QK_COLS: gl.constexpr = 0,
                        DP_COLS: gl.constexpr = 0):
    """(d = 256) One warpgroup of the column-split dK/dV kernel: 64 keys per CTA, dK and dV split
    by columns (warpgroup w holds columns [128 w, 128 w + 128): 64 + 64 registers a thread where
    the full width would need 256). Per step of 64 query rows, warpgroup 0 forms Pᵀ = exp(Sᵀ -
    LSE) and warpgroup 1 dPᵀ (one 64 x 64 x 256 GEMM each, nothing computed twice); Pᵀ goes to
    warpgroup 1 through shared memory (p_ready), which forms dSᵀ = Pᵀ (dPᵀ - delta) and hands it
    back the same way (ds_ready); then each adds its columns of Pᵀ·dO to dV and dSᵀ·Q to dK.
    The two buffers of each alternate by step; a warpgroup reaches step t + 2 only after waiting
    on the other's hand-off of step t + 1, which the other makes after retiring its step-t
    GEMMs, so a buffer is never rewritten while read. ROW_STATS: LSE and delta come from the
    stage's ld_smem rows (``_dkdv_producer``), read just before their use."""
    HEAD_D: gl.constexpr = q_smem.shape[2]
    COLS: gl.constexpr = HEAD_D // 2
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = wgmma_acc_layout(HALF)  # Sᵀ / dPᵀ: [64 keys, 64 query rows]
    a_layout: gl.constexpr = wgmma_acc_layout(COLS)  # this warpgroup's dK / dV columns
    op_layout: gl.constexpr = wgmma_a_operand(a_layout)
    key_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_l: gl.constexpr = gl.SliceLayout(0, s_layout)

    k = k_smem.index(0)
    v = v_smem.index(0)
    off = seqlen_k - seqlen_q
    cols = start_n + gl.arange(0, HALF, layout=key_l)  # the CTA's keys (Sᵀ rows)
    dk = gl.zeros([HALF, COLS], gl.float32, layout=a_layout)
    dv = gl.zeros([HALF, COLS], gl.float32, layout=a_layout)
    s_zero = gl.zeros([HALF, HALF], gl.float32, layout=s_layout)
    if n_steps > 0:
        mbarrier.wait(kv_bar, 0)
    fixes = n_steps * 0  # (varlen) parity per stage of the zeroed-rows barriers
    for t in range(n_steps):
        st = t % STAGES
        b = t % 2
        g = t // n_m
        m0 = lo_m + (t - g * n_m) * HALF
        rows = m0 + gl.arange(0, HALF, layout=row_l)
        row_ok = rows < seqlen_q
        row_base = LSE + lse_base + (h0 + g).to(gl.int64) * stride_lh + rows
        q, do, fixes = _qdo_stage(t, q_smem, do_smem, qdo_full, fixed, fixes, m0, seqlen_q,
                                  STAGES, IS_VARLEN)
        p_buf = p_smem.index(b)
        ds_buf = ds_smem.index(b)
        if WG == 0:
            if not ROW_STATS:
                lse2 = _lse_base2(gl.load(row_base, mask=row_ok, other=float("inf")))
            s_tok = mma_over_cols(k, q, s_zero, QK_COLS)
            s = warpgroup_mma_wait(0, deps=[s_tok])
            if ROW_STATS:
                lse2 = ld_smem.index(2 * st).load(row_l)
            if _tile_needs_mask(m0, start_n, seqlen_q, seqlen_k, off, window_left, window_right,
                                HAS_LEFT, HAS_RIGHT, HALF):
                s = _mask_scores(s, rows[None, :], cols[:, None], seqlen_q, seqlen_k, off,
                                 window_left, window_right, HAS_LEFT, HAS_RIGHT)
            p = gl.exp2(s * qk_scale_log2 - lse2[None, :]).to(dtype)
            p_buf.store(p)
            fence_async_shared()
            gl.thread_barrier()  # the whole warpgroup's stores, before its one arrival
            mbarrier.arrive(p_ready.index(b), count=1)
            dv_tok = warpgroup_mma(gl.convert_layout(p, op_layout), do.slice(0, COLS, dim=1), dv,
                                   is_async=True)
            mbarrier.wait(ds_ready.index(b), (t // 2) & 1)
            dk_tok = warpgroup_mma(ds_buf, q.slice(0, COLS, dim=1), dk, is_async=True)
        else:
            if not ROW_STATS:
                delta = gl.load(DELTA + lse_base + (h0 + g).to(gl.int64) * stride_lh + rows,
                                mask=row_ok, other=0.0)
            dp_tok = mma_over_cols(v, do, s_zero, DP_COLS)
            dp = warpgroup_mma_wait(0, deps=[dp_tok])
            if ROW_STATS:
                delta = ld_smem.index(2 * st + 1).load(row_l)
            mbarrier.wait(p_ready.index(b), (t // 2) & 1)
            dv_tok = warpgroup_mma(p_buf, do.slice(COLS, COLS, dim=1), dv, is_async=True)
            p = p_buf.load(s_layout).to(gl.float32)
            ds = (p * (dp - delta[None, :]) * sm_scale).to(dtype)  # scaled: dK comes out scaled
            ds_buf.store(ds)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ds_ready.index(b), count=1)
            dk_tok = warpgroup_mma(gl.convert_layout(ds, op_layout), q.slice(COLS, COLS, dim=1),
                                   dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
        mbarrier.arrive(qdo_empty.index(st), count=1)

    d_cols = WG * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, a_layout))
    keys = start_n + gl.arange(0, HALF, layout=gl.SliceLayout(1, a_layout))
    ok = (keys < seqlen_k)[:, None]
    store_cols(DK + dk_off + keys[:, None].to(gl.int64) * stride_dkn + d_cols[None, :],
               dk.to(dtype), ok, d_cols, K_COLS)
    store_cols(DV + dv_off + keys[:, None].to(gl.int64) * stride_dvn + d_cols[None, :],
               dv.to(dtype), ok, d_cols, V_COLS)


@gluon.jit
def _bwd_dkdv_cols_sm90(q_desc, do_desc, k_desc, v_desc, DK, DV, LSE, DELTA, CU_Q, CU_K,
                        stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_lb, stride_lh,
                        n_heads_k, kv_group, seqlen_q_fixed, seqlen_k_fixed,
                        sm_scale, qk_scale_log2, window_left, window_right,
                        IS_VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                        STAGES: gl.constexpr, CONSUMER_REGS_: gl.constexpr,
                        PRODUCER_REGS_: gl.constexpr, ROW_STATS: gl.constexpr = False,
                        K_COLS: gl.constexpr = 0, V_COLS: gl.constexpr = 0, head_group=1,
                        QK_COLS: gl.constexpr = 0, DP_COLS: gl.constexpr = 0):
    """(d = 256) dK and dV of 64 keys per CTA (``_dkdv_cols_consumer``); dQ comes from the dQ
    kernel. Shared memory at d = 256 with 2 stages: K, V 64 KB, Q/dO 128 KB, Pᵀ/dSᵀ 32 KB."""
    HEAD_D: gl.constexpr = box_cols(q_desc.block_type.shape)
    (off_hk, q_start, seqlen_q, k_start, seqlen_k, start_n, lo_m, n_steps, h0, dk_off, dv_off,
     lse_base) = _key_block(CU_Q, CU_K, n_heads_k, kv_group, seqlen_q_fixed, seqlen_k_fixed,
                            window_left, window_right, stride_dkn, stride_dkh, stride_dvn,
                            stride_dvh, stride_lb, HALF, IS_VARLEN, HAS_LEFT, HAS_RIGHT,
                            head_group)
    n_m = n_steps // kv_group
    if start_n >= seqlen_k:
        return

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, HALF, HEAD_D],
                                       tile_layout(q_desc.layout))
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, HALF, HEAD_D],
                                        tile_layout(do_desc.layout))
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [1, HALF, HEAD_D],
                                       tile_layout(k_desc.layout))
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [1, HALF, HEAD_D],
                                       tile_layout(v_desc.layout))
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HALF], q_desc.dtype)
    p_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, HALF], pds_layout)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, HALF], pds_layout)
    kv_bar = barriers(1, 1)
    fixed = barriers(STAGES, 1)  # zeroed tail rows per Q/dO stage (no K/V zeroing here)
    p_ready = barriers(2, 1)
    ds_ready = barriers(2, 1)
    qdo_full = barriers(STAGES, 2 if ROW_STATS else 1)  # (ROW_STATS) + the rows' LSE / delta
    qdo_empty = barriers(STAGES, 2)  # one arrive per consumer warpgroup
    if ROW_STATS:  # per stage: its 64 rows' LSE (base 2) and delta (``_dkdv_producer``)
        ld_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, HALF],
                                            gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        ld_smem = fixed  # unused
    fence_async_shared()

    gl.warp_specialize([
        (_dkdv_cols_consumer, (DK, DV, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, p_smem,
                               ds_smem, kv_bar.index(0), qdo_full, qdo_empty, fixed, p_ready,
                               ds_ready, dk_off, dv_off, stride_dkn, stride_dvn, lse_base,
                               stride_lh, h0, lo_m, n_m, n_steps, start_n, q_start, seqlen_q,
                               seqlen_k, window_left, window_right, qk_scale_log2, sm_scale,
                               ld_smem, 0, STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN, ROW_STATS,
                               K_COLS, V_COLS, QK_COLS, DP_COLS)),
        (_dkdv_cols_consumer, (DK, DV, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, p_smem,
                               ds_smem, kv_bar.index(0), qdo_full, qdo_empty, fixed, p_ready,
                               ds_ready, dk_off, dv_off, stride_dkn, stride_dvn, lse_base,
                               stride_lh, h0, lo_m, n_m, n_steps, start_n, q_start, seqlen_q,
                               seqlen_k, window_left, window_right, qk_scale_log2, sm_scale,
                               ld_smem, 1, STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN, ROW_STATS,
                               K_COLS, V_COLS, QK_COLS, DP_COLS)),
        (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                          kv_bar.index(0), qdo_full, qdo_empty, fixed, q_start, k_start + start_n,
                          off_hk * HEAD_D, h0, lo_m, n_m, n_steps, seqlen_q, seqlen_k - start_n,
                          LSE, DELTA, ld_smem, lse_base, stride_lh, STAGES, IS_VARLEN, False, 1,
                          ROW_STATS)),
    ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])

    invalidate(kv_bar, 1)
    invalidate(fixed, STAGES)
    invalidate(p_ready, 2)
    invalidate(ds_ready, 2)
    invalidate(qdo_full, STAGES)
    invalidate(qdo_empty, STAGES)


# ----------------------------------------------------------------------------------------- dQ
@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, kv_full,
                 kv_empty, kv_fixed, q_row, q_col, k_row, kv_col, n_tiles, n_keys,
                 STAGES: gl.constexpr, IS_VARLEN: gl.constexpr):
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    has_work = n_tiles > 0
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes,
                    pred=has_work)
    for i in gl.static_range(2):
        tma_load(q_desc, q_row + i * HALF, q_col, q_bar, q_smem.index(i), pred=has_work)
        tma_load(do_desc, q_row + i * HALF, q_col, q_bar, do_smem.index(i), pred=has_work)
    for j in range(n_tiles):
        st = j % STAGES
        mbarrier.wait(kv_empty.index(st), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(kv_full.index(st), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, k_row + j * BLOCK_N, kv_col, kv_full.index(st), k_smem.index(st))
        tma_load(v_desc, k_row + j * BLOCK_N, kv_col, kv_full.index(st), v_smem.index(st))
    if IS_VARLEN:
        # the last K/V tile may run past the last packed sequence: zero those rows (dS·K and
        # dP = dO·Vᵀ would carry 0 * NaN into dQ) before the consumers read it
        zero_last_key_tile(kv_full, kv_fixed, k_smem, v_smem, n_tiles, n_keys, STAGES, True)


@gluon.jit
def _dq_issue_sdp(q, do, k_smem, v_smem, kv_full, kv_fixed, s_zero, j, lo, seqlen_k,
                  STAGES: gl.constexpr, IS_VARLEN: gl.constexpr, QK_COLS: gl.constexpr = 0,
                  DP_COLS: gl.constexpr = 0):
    """Wait for key tile j (and, varlen, for its zeroed tail rows), then issue S = Q·Kᵀ and
    dP = dO·Vᵀ on it."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    st = j % STAGES
    mbarrier.wait(kv_full.index(st), (j // STAGES) & 1)
    if IS_VARLEN:
        if lo + (j + 1) * BLOCK_N > seqlen_k:  # the last tile: rows past the end zeroed
            mbarrier.wait(kv_fixed, 0)
    # (QK_COLS / DP_COLS, IOATTN_SM90_PAD_NARROW: over d's / d_v's own columns, ``mma_over_cols``)
    s_tok = mma_over_cols(q, k_smem.index(st), s_zero, QK_COLS)
    dp_tok = mma_over_cols(do, v_smem.index(st), s_zero, DP_COLS)
    return s_tok, dp_tok


@gluon.jit
def _dq_scores(s, dp, rows, row0, col0, lse2, delta, seqlen_q, seqlen_k, off, window_left,
               window_right, qk_scale_log2,
               softcap_scale, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """dS = P (dP - delta) of one key tile from col0, P = exp2(S·scale - LSE) under the masks
    (softcap: S is tanh(S · softcap_scale) first, and dS carries its derivative 1 - tanh²)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    s = softcap_tanh(s, softcap_scale)
    if softcap_scale is not None:
        dtanh = 1.0 - s * s
    if _tile_needs_mask(row0, col0, seqlen_q, seqlen_k, off, window_left, window_right,
                        HAS_LEFT, HAS_RIGHT):
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        s = _mask_scores(s, rows[:, None], cols[None, :], seqlen_q, seqlen_k, off, window_left,
                         window_right, HAS_LEFT, HAS_RIGHT)
    p = gl.exp2(s * qk_scale_log2 - lse2[:, None])
    if softcap_scale is not None:
        p = p * dtanh
    return p * (dp - delta[:, None])


@gluon.jit
def _dq_consumer(DQ, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, q_bar, kv_full, kv_empty,
                 kv_fixed, dq_off, stride_dqm, lse_off, start_m, seqlen_q, seqlen_k, lo, n_tiles,
                 window_left, window_right, qk_scale_log2, softcap_scale, sm_scale,
                 WG: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                 HAS_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr, K_COLS: gl.constexpr,
                 QK_COLS: gl.constexpr = 0, DP_COLS: gl.constexpr = 0):
    HEAD_D: gl.constexpr = q_smem.shape[2]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = wgmma_acc_layout(BLOCK_N)
    a_layout: gl.constexpr = wgmma_acc_layout(HEAD_D)
    op_layout: gl.constexpr = wgmma_a_operand(a_layout)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)

    q = q_smem.index(WG)
    do = do_smem.index(WG)
    row0 = start_m + WG * HALF
    off = seqlen_k - seqlen_q
    rows = row0 + gl.arange(0, HALF, layout=row_l)
    row_ok = rows < seqlen_q
    lse = gl.load(LSE + lse_off + rows, mask=row_ok, other=float("inf"))
    delta = gl.load(DELTA + lse_off + rows, mask=row_ok, other=0.0)
    lse2 = _lse_base2(lse)
    dq = gl.zeros([HALF, HEAD_D], gl.float32, layout=a_layout)
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
    if n_tiles > 0:
        mbarrier.wait(q_bar, 0)
    for j in range(n_tiles):
        st = j % STAGES
        s_tok, dp_tok = _dq_issue_sdp(q, do, k_smem, v_smem, kv_full, kv_fixed, s_zero, j, lo,
                                      seqlen_k, STAGES, IS_VARLEN, QK_COLS, DP_COLS)
        s, dp = warpgroup_mma_wait(0, deps=[s_tok, dp_tok])
        ds = _dq_scores(s, dp, rows, row0, lo + j * BLOCK_N, lse2, delta, seqlen_q, seqlen_k,
                        off, window_left, window_right, qk_scale_log2,
                        softcap_scale, HAS_LEFT, HAS_RIGHT)
        dq_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), k_smem.index(st),
                               dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
        mbarrier.arrive(kv_empty.index(st), count=1)

    d_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, a_layout))
    out_rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, a_layout))
    store_cols(DQ + dq_off + out_rows[:, None].to(gl.int64) * stride_dqm + d_cols[None, :],
               (dq * sm_scale).to(dtype), (out_rows < seqlen_q)[:, None], d_cols, K_COLS)


@gluon.jit
def _bwd_dq_sm90(q_desc, do_desc, k_desc, v_desc, DQ, LSE, DELTA, CU_Q, CU_K,
                 stride_dqm, stride_dqh, stride_lb, stride_lh,
                 n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed,
                 sm_scale, qk_scale_log2, window_left, window_right,
                 IS_VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                 STAGES: gl.constexpr, CONSUMER_REGS_: gl.constexpr, PRODUCER_REGS_: gl.constexpr,
                 softcap_scale=None, K_COLS: gl.constexpr = 0, head_group=1,
                 QK_COLS: gl.constexpr = 0, DP_COLS: gl.constexpr = 0):
    HEAD_D: gl.constexpr = box_cols(q_desc.block_type.shape)
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = 2 * HALF
    (off_b, off_h, off_hk, q_start, seqlen_q, k_start, seqlen_k, lse_start, start_m, lo,
     n_tiles) = query_tile(CU_Q, CU_K, n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed, window_left,
                           window_right, BLOCK_M, BLOCK_N, IS_VARLEN, HAS_LEFT, HAS_RIGHT, False,
                           head_group)
    if start_m >= seqlen_q:
        return

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, HEAD_D],
                                       tile_layout(q_desc.layout))
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, HALF, HEAD_D],
                                        tile_layout(do_desc.layout))
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D],
                                       tile_layout(k_desc.layout))
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_D],
                                       tile_layout(v_desc.layout))
    q_bar = barriers(1, 1)
    kv_fixed = barriers(1, 1)
    kv_full = barriers(STAGES, 1)
    kv_empty = barriers(STAGES, 2)  # one arrive per consumer warpgroup
    fence_async_shared()

    q_row = q_start + start_m
    dq_off = q_start.to(gl.int64) * stride_dqm + off_h.to(gl.int64) * stride_dqh
    lse_off = off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + lse_start
    gl.warp_specialize([
        (_dq_consumer, (DQ, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, q_bar.index(0), kv_full,
                        kv_empty, kv_fixed.index(0), dq_off, stride_dqm, lse_off, start_m, seqlen_q, seqlen_k, lo, n_tiles,
                        window_left, window_right, qk_scale_log2, softcap_scale, sm_scale,
                        0, STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN, K_COLS, QK_COLS, DP_COLS)),
        (_dq_consumer, (DQ, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, q_bar.index(0), kv_full,
                        kv_empty, kv_fixed.index(0), dq_off, stride_dqm, lse_off, start_m, seqlen_q, seqlen_k, lo, n_tiles,
                        window_left, window_right, qk_scale_log2, softcap_scale, sm_scale,
                        1, STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN, K_COLS, QK_COLS, DP_COLS)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                        q_bar.index(0), kv_full, kv_empty, kv_fixed.index(0), q_row, off_h * HEAD_D,
                        k_start + lo, off_hk * HEAD_D, n_tiles, seqlen_k - lo, STAGES, IS_VARLEN)),
    ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])

    invalidate(q_bar, 1)
    invalidate(kv_fixed, 1)
    invalidate(kv_full, STAGES)
    invalidate(kv_empty, STAGES)


# ------------------------------------------------------------------------------------- host
def dq_cols(head_dim: int) -> int:
    """dQ's columns per consumer warpgroup in the fused backward: half from d = 128 (the two
    warpgroups split one partial over all 128 keys), all at d = 64, where a half would cut the
    128-byte swizzled rows of K in shared memory (each warpgroup then reduces a full-width
    partial over its own 64 keys)."""
    return head_dim // 2 if head_dim >= 128 else head_dim


def unsupported_reason(head_dim: int, head_dim_v: int, softcap: float, has_alibi: bool,
                       dropout_p: float) -> str | None:
    """Why the sm90 backward does not cover a call whose forward the sm90 forward accepts (None
    when it does): the layouts were checked there (dout is copied to a TMA view when needed)."""
    # (the zero-padded pairs run at their padded head dim, as the forward)
    native = PADDED_HEAD_DIMS.get((head_dim, head_dim_v), head_dim)
    if native not in SUPPORTED_HEAD_DIMS or (head_dim_v != head_dim
                                             and (head_dim, head_dim_v) not in PADDED_HEAD_DIMS):
        extra = "; d=256 unless IOATTN_SM90_BWD_D256=0" if not D256 else ""
        return (f"head dims (d={head_dim}, d_v={head_dim_v}) are not covered by the sm90 backward "
                f"(d = d_v in {SUPPORTED_HEAD_DIMS}{extra})")
    if has_alibi or dropout_p > 0:
        return "ALiBi and dropout are not covered by the sm90 backward yet"
    if softcap > 0 and native == 256:
        # (the column-split kernel forms P and dS in different warpgroups: 1 - tanh² would have
        # to cross shared memory too)
        return f"softcap is not covered by the sm90 backward at d={head_dim} yet"
    return None


def dq_order(head_dim: int, masked: bool, rows: int = 64) -> str:
    """(fused) Where each step's dQ partial is issued (``DQ_ORDERS``; ``DQ_ORDER`` overrides
    "auto", which takes what measured fastest): "alt" at d = 64, at d = 128 "lag" without a mask
    and "after" under one (causal or a window; with the row stats in shared memory "after" ran
    +2-4% over "first", results/tune/sm90_bwd_rowstats_orders_ef679d0_*.log). "alt" needs the
    full-width partial (d = 64); asked for elsewhere it is "after". 128-row steps (rows,
    ``step_rows``) take "after" or "first" (each warpgroup's partial is its half of the rows)."""
    order = DQ_ORDER
    if order == "auto":
        order = "alt" if head_dim == 64 else ("after" if masked else "lag")
    if order not in DQ_ORDERS:
        raise ValueError(f"IOATTN_SM90_BWD_DQ_ORDER={DQ_ORDER!r}: expected auto or one of "
                         f"{', '.join(DQ_ORDERS)}")
    if rows != HALF.value and order in ("alt", "lag"):
        return "after"
    return "after" if order == "alt" and dq_cols(head_dim) != head_dim else order


def step_rows(head_dim: int, fused: bool) -> int:
    """Query rows a step of the d <= 128 dK/dV kernel (``ROWS_MODE``): 128 in the fused form at
    d = 64 ("auto", "128"; it measured +4-11% there); else 64."""
    if ROWS_MODE not in ("auto", "64", "128"):
        raise ValueError(f"IOATTN_SM90_BWD_ROWS={ROWS_MODE!r}: expected auto, 64 or 128")
    return 128 if ROWS_MODE != "64" and fused and head_dim == 64 else HALF.value


def dkdv_stages(head_dim: int, rows: int = 64) -> int:
    """Q/dO stages of the d <= 128 dK/dV kernel (``STAGES_MODE``; d = 128 always 2); 3 / 4 on
    64-row steps only (the 128-row steps' ring takes 194 KB of shared memory at 2)."""
    if STAGES_MODE == "auto" or head_dim != 64:
        return DKDV_STAGES
    if STAGES_MODE not in ("2", "3", "4"):
        raise ValueError(f"IOATTN_SM90_BWD_STAGES={STAGES_MODE!r}: expected auto, 2, 3 or 4")
    if rows != HALF.value and STAGES_MODE != "2":
        raise ValueError(f"IOATTN_SM90_BWD_STAGES={STAGES_MODE}: the 128-row steps of the d=64 "
                         "backward fit 2 stages; set IOATTN_SM90_BWD_ROWS=64 for a deeper ring")
    return int(STAGES_MODE)


def segments(head_dim: int, masked: bool) -> bool:
    """(fused and two-kernel dK/dV, d <= 128) whether the steps run in masked / unmasked loops.
    "auto" takes them where they measured faster on the H200: d = 64 without a mask, +3-4% from
    8k (results/sm90_bwd_seg{1,0}_700c91d_*.json; +1-4% in results/sm90_bwd_seg{1,0}_76fc236_*);
    causal d = 64 ran -5 to +3% and d = 128 0.87-0.95x (its loops spill more)."""
    if SEGMENTS == "auto":
        return head_dim == 64 and not masked
    if SEGMENTS in ("1", "true", "on"):
        return True
    if SEGMENTS in ("0", "false", "off"):
        return False
    raise ValueError(f"IOATTN_SM90_BWD_SEGMENTS={SEGMENTS!r}: expected auto, 1 or 0")


def preferred(head_dim: int, masked: bool, max_seqlen_k: int, softcap: float = 0.0,
              head_dim_v: int | None = None, varlen: bool = False,
              max_seqlen_q: int | None = None, window: bool = False) -> bool:
    """Whether 'auto' should take the sm90 backward over the portable one: where it measured
    faster on the H200. With the row stats in shared memory (results/sm90_bwd_rowstats1_ef679d0_*)
    it runs from 2k keys at every head dim: d=64 387 / 311 TFLOP/s non-causal / causal at 2k
    against the portable 364 / 307 (results/dense_76fc236_*.json), d=128 493 / 373 against 442
    (sm90 without row stats) / 323, d=256 398 / 331 against 131-150; d=256 also from 512 keys:
    279 / 152 at 512 and 353 / 256 at 1k against the portable 117 / 94 and 133 / 114 (cuDNN 240 /
    180 and 303 / 256; results/bwd256_short_6d04479_*.json). Shorter problems were not measured
    in these forms: the portable kernel keeps them. Softcap (d in {64, 128}, the
    forward's tanh.approx) from 2k keys too: 1.15-1.73x the portable kernel at cap 30
    (results/softcap_approx_b84f621_*.json). The zero-padded head dims: (192, 192) from 2k keys
    (1.67-2.92x the portable kernel, which runs d=192 at 93-108 TFLOP/s), (96, 96) from 8k
    (1.17x / 1.08x non-causal / causal; 0.74-0.86x at 2k), results/padded_b84f621_*.json; (192, 128) was
    not timed and stays portable. Read in place (PAD_MODE "tma", the default since session 15;
    results/pad_tma_ae73752_*.json): (192, 192) and (192, 128) from 1k keys (283 / 206 and
    249 / 171 TFLOP/s non-causal / causal at 1k against the portable 99 / 83 and 103 / 90),
    (96, 96) from 1k too (310 / 215 against 261 / 180, results/bwd96_short_3b476a9_*.json;
    the first run's causal 1k cell tied, 162 / 162). Shorter ones were not timed.

    The FA grid's short cells (batched, queries = keys, bf16; the sm90 backend forced beside
    auto's portable kernel in one run, results/short_4528809_nvidia-h200_2026-12-07.json),
    TFLOP/s sm90 / portable: d=64 non-causal 512 284 / 265, 1k 369 / 330, causal 167 / 172 and
    255 / 230; d=128 non-causal 297 / 271 and 417 / 345, causal 96 / 171 and 172 / 246. So
    batched calls without softcap take it from 512 queries and keys at d=64 (causal from 1k)
    and at d=128 without a mask (``max_seqlen_q`` given: few queries over many keys leave each
    key block's CTA a step or two, the short loop where the causal cells lost); d=128 causal
    keeps 2k. Only these were timed: 16k tokens a call, queries = keys, no GQA, bf16. Varlen
    and sliding windows (``window``) keep the rules above (not timed there)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if (head_dim, head_dim_v) in PADDED_HEAD_DIMS:
        if softcap > 0:
            return False
        if sm90_common.PAD_MODE != "tma":  # the zero-padded copies
            return head_dim_v == head_dim and max_seqlen_k >= (8192 if head_dim == 96 else 2048)
        return max_seqlen_k >= 1024
    if head_dim not in SUPPORTED_HEAD_DIMS or head_dim_v != head_dim:
        return False
    if head_dim == 256:
        return softcap == 0 and max_seqlen_k >= 512
    if softcap == 0 and not (varlen or window) and max_seqlen_q is not None \
            and (head_dim == 64 or not masked) \
            and min(max_seqlen_q, max_seqlen_k) >= (1024 if masked else 512):
        return True  # batched: d=64 from 512 (causal 1k), d=128 non-causal from 512
    return max_seqlen_k >= 2048 and (softcap == 0 or head_dim in (64, 128))


def attn_bwd_sm90(p: AttnParams, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dlse: Optional[torch.Tensor], dq: torch.Tensor, dk: torch.Tensor,
                  dv: torch.Tensor, delta: torch.Tensor, bind_key: Optional[tuple] = None, *,
                  fused: Optional[bool] = None) -> None:
    """The backward into preallocated dq/dk/dv (arguments as ``triton_bwd.attn_bwd``).

    fused (default ``FUSED``; keyword only): one kernel, dQ's partials added to an fp32 buffer by TMA
    reductions (5 GEMMs per tile; the order of the additions varies, so not bitwise
    reproducible). Otherwise dK/dV and dQ in two kernels without atomics (7 GEMMs).
    bind_key (batched calls, from the op): the op's memo signature of this call with dLSE's
    form and every given tensor's 16-byte alignment, which fixes every argument but the
    addresses (dq / dk / dv, delta and the fused form's buffer are new allocations shaped from
    q, k, v and LSE; the unused pointers are LSE's): with ``fused``, this module's switches
    (``_switches``) and the SM count it keys the kept launches (``_Kept``, ``BIND``)."""
    fused = FUSED if fused is None else fused
    if p.batch * q.shape[-2] == 0:
        return
    if p.max_seqlen_k == 0:  # no keys: every dQ is 0, dK/dV are empty
        dq.zero_()
        return
    if p.max_seqlen_q == 0:  # no queries: dK/dV are 0
        dk.zero_()
        dv.zero_()
        return
    if bind_key is not None and BIND:  # (sm_count: the grids' head groups; tests patch it)
        bind_key = (bind_key, fused, _switches(), sm_count(q.device))
        kept = _BOUND.get(bind_key)
        if kept is not None and kept(dout, q, k, v, out, lse, dlse, dq, dk, dv, delta):
            return
    else:
        bind_key = None
    pre = bwd_preprocess(p, out, dout, lse, dlse, delta,
                         None if bind_key is None else (bind_key, "sm90 preprocess"))
    bounds = []  # (bind_key) the dK/dV and dQ kernels' Bounds, in launch order

    def run(kernel, grid, args, kwargs, n_slots):
        if bind_key is None:
            launcher(kernel)[grid](*args, **kwargs)
        else:  # (slots: the descriptors' bases and the pointers, the first n_slots arguments)
            bounds.append(launcher(kernel).bind(grid, args, kwargs, tuple(range(n_slots))))

    n_heads, n_heads_k = q.shape[-2], k.shape[-2]
    half = HALF.value
    # head dims in PADDED_HEAD_DIMS read in place (IOATTN_SM90_PAD=tma): the kernels run at d_pad
    # columns, their loads zero-filled past d / d_v, their stores masked there
    d_pad = PADDED_HEAD_DIMS.get((q.shape[-1], v.shape[-1]))
    cols = dict(K_COLS=q.shape[-1], V_COLS=v.shape[-1]) if d_pad else {}
    # (IOATTN_SM90_PAD_NARROW) Sᵀ / S over d's own columns and dPᵀ / dP over d_v's in the
    # column-split dK/dV kernel and the dQ kernel (the fused one keeps the padded width)
    narrow = (dict(QK_COLS=q.shape[-1], DP_COLS=v.shape[-1])
              if d_pad and sm90_common.PAD_NARROW else {})
    q_desc = rows_descriptor(q, p.is_varlen, half, pad_to=d_pad)
    do_desc = rows_descriptor(dout, p.is_varlen, half, pad_to=d_pad)
    dummy = lse
    cu_q = p.cu_seqlens_q if p.is_varlen else dummy
    cu_k = p.cu_seqlens_k if p.is_varlen else dummy
    flags = dict(IS_VARLEN=p.is_varlen, HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0,
                 CONSUMER_REGS_=CONSUMER_REGS, PRODUCER_REGS_=PRODUCER_REGS, num_warps=4)
    # (softcap: dS gains 1 - tanh², dK and dQ keep softmax_scale)
    qk_scale_log2, softcap_scale = score_scales(p.softmax_scale, p.softcap)
    scalars = (p.softmax_scale, qk_scale_log2, p.window_left, p.window_right)
    lse_strides = p.lse_strides(lse)
    d = d_pad or q.shape[-1]
    acc_cols, tma_store = 0, False  # (the fused form's fp32 dQ buffer's columns; dK/dV by TMA)
    if d == 256:  # the column-split dK/dV kernel, then the dQ kernel on 32-key tiles
        if softcap_scale is not None:  # (unsupported_reason refuses it: never a silent no-op)
            raise ValueError("softcap is not covered by the sm90 backward at d=256 yet")
        grid = (-(-p.max_seqlen_k // half), p.batch * n_heads_k)
        run(_bwd_dkdv_cols_sm90, grid, (
            q_desc, do_desc, rows_descriptor(k, p.is_varlen, half, pad_to=d_pad),
            rows_descriptor(v, p.is_varlen, half, pad_to=d_pad), dk, dv, lse, delta, cu_q, cu_k,
            dk.stride(-3), dk.stride(-2), dv.stride(-3), dv.stride(-2), *lse_strides,
            n_heads_k, n_heads // n_heads_k, p.max_seqlen_q, p.max_seqlen_k, *scalars),
            dict(STAGES=DKDV_STAGES, ROW_STATS=ROW_STATS, head_group=_order(grid, p, q.device),
                 **cols, **narrow, **flags), 10)
    else:
        # fused: rows no key block reaches get no partial, so the buffer starts at 0
        # (a padded head dim: the buffer at d columns a head, as the kernel's tiles)
        acc_cols = d if fused else 0
        dq_acc = _dq_buffer(q, d) if fused else None
        rows = step_rows(d, fused)
        order = dq_order(d, p.causal_like, rows) if fused else "after"
        grid = (-(-p.max_seqlen_k // (2 * half)), p.batch * n_heads_k)
        # dK / dV stored by TMA (full key halves) where they form [rows, heads * d] matrices
        # (the head dims read in place keep the masked stores from registers)
        tma_store = (TMA_STORE and d_pad is None
                     and all(_tma_writable(t, p.is_varlen) for t in (dk, dv)))
        if rows != half:  # Q / dO by 128-row boxes (``step_rows``; d = 64, no padded views)
            q_desc = rows_descriptor(q, p.is_varlen, rows)
            do_desc = rows_descriptor(dout, p.is_varlen, rows)
        run(_bwd_dkdv_sm90, grid, (
            # (fused, 3D views: K in one 128-row box, ``_dkdv_producer``)
            q_desc, do_desc,
            rows_descriptor(k, p.is_varlen, 2 * half if fused and d_pad else half, pad_to=d_pad),
            rows_descriptor(v, p.is_varlen, half, pad_to=d_pad),
            # (fused) each warpgroup reduces its columns of dQ
            rows_descriptor(dq_acc, p.is_varlen, half, dq_cols(d)) if fused else q_desc,
            rows_descriptor(dk, p.is_varlen, half) if tma_store else q_desc,
            rows_descriptor(dv, p.is_varlen, half) if tma_store else q_desc,
            dk, dv, lse, delta, cu_q, cu_k,
            dk.stride(-3), dk.stride(-2), dv.stride(-3), dv.stride(-2), *lse_strides,
            n_heads_k, n_heads // n_heads_k, p.max_seqlen_q, p.max_seqlen_k, *scalars), dict(
            STAGES=dkdv_stages(d, rows), FUSED_DQ=fused, DQ_LAG=order == "lag",
            DQ_ALT=order == "alt", DQ_FIRST=order == "first", SEGMENTS=segments(d, p.causal_like),
            ROW_STATS=ROW_STATS, softcap_scale=softcap_scale, TMA_STORE=tma_store,
            head_group=_order(grid, p, q.device), **cols, **flags), 13)
    if acc_cols:
        dq.copy_(dq_acc[..., :dq.shape[-1]])  # (a padded head dim: its first d columns)
    else:
        block_n = _dq_block_n(d)
        grid = (-(-p.max_seqlen_q // (2 * half)), p.batch * n_heads)
        run(_bwd_dq_sm90, grid, (
            q_desc, do_desc, rows_descriptor(k, p.is_varlen, block_n, pad_to=d_pad),
            rows_descriptor(v, p.is_varlen, block_n, pad_to=d_pad), dq, lse, delta, cu_q, cu_k,
            dq.stride(-3), dq.stride(-2), *lse_strides,
            n_heads, n_heads // n_heads_k, p.max_seqlen_q, p.max_seqlen_k, *scalars), dict(
            STAGES=DQ_STAGES, softcap_scale=softcap_scale, K_COLS=cols.get("K_COLS", 0),
            head_group=_order(grid, p, q.device), **narrow, **flags), 9)
    if pre is not None and all(b is not None for b in bounds):
        keep(_BOUND, bind_key, _Kept(pre, bounds, d == 256, acc_cols, tma_store))


class _Kept:
    """The launches of one batched backward signature kept for repeats (``attn_bwd_sm90``'s
    bind_key): the preprocess, then the dK/dV kernel (``split_cols``: d = 256's column-split
    one; dK / dV by TMA or not, ``tma_store``) and either the dQ kernel or (``acc_cols`` > 0,
    the fused form) the conversion of a new fp32 dQ buffer of that many columns a head. Called
    with a call's tensors, it launches them at their addresses in the slots' order of the first
    call (descriptor bases, then the pointers; the unused cu_seqlens pointers are LSE's); False
    when a Bound steps aside (launch hooks, Triton's switches, another device): the caller then
    launches everything the plain way (the preprocess again: it only writes delta)."""

    __slots__ = ("pre", "bounds", "split_cols", "acc_cols", "tma_store")

    def __init__(self, pre, bounds, split_cols: bool, acc_cols: int, tma_store: bool) -> None:
        self.pre, self.bounds, self.split_cols = pre, bounds, split_cols
        self.acc_cols, self.tma_store = acc_cols, tma_store

    def __call__(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, delta) -> bool:
        lp, dp, qp, dop = lse.data_ptr(), delta.data_ptr(), q.data_ptr(), dout.data_ptr()
        if not self.pre(out.data_ptr(), dop, (dlse if dlse is not None else delta).data_ptr(), dp):
            return False
        kv = (qp, dop, k.data_ptr(), v.data_ptr())
        grads = (dk.data_ptr(), dv.data_ptr())
        tail = (lp, dp, lp, lp)  # (LSE, delta, the unused cu_seqlens pointers)
        if self.split_cols:  # (d = 256: the column-split dK/dV kernel, then the dQ kernel)
            ok = self.bounds[0](*kv, *grads, *tail)
        else:
            acc = _dq_buffer(q, self.acc_cols) if self.acc_cols else q
            stored = grads if self.tma_store else (qp, qp)  # (dK / dV descriptors, or q's)
            ok = self.bounds[0](*kv, acc.data_ptr(), *stored, *grads, *tail)
            if ok and self.acc_cols:
                dq.copy_(acc[..., :dq.shape[-1]])
                return True
        return ok and self.bounds[1](*kv, dq.data_ptr(), *tail)


def _dq_buffer(q: torch.Tensor, cols: int) -> torch.Tensor:
    """(fused) dQ's fp32 buffer at ``cols`` columns a head (the kernels' head dim), zeroed: rows
    no key block reaches get no partial."""
    return torch.zeros(q.shape[:-1] + (cols,), dtype=torch.float32, device=q.device)


def _switches() -> tuple:
    """The module settings the backward's launch rules read (tests change some between calls of
    one shape), for kept launches keyed by the op's signature."""
    return (HALF.value, CONSUMER_REGS, PRODUCER_REGS, DKDV_STAGES, STAGES_MODE, DQ_BLOCK_N,
            DQ_STAGES, ROWS_MODE, SEGMENTS, ROW_STATS, LPT, DQ_ORDER, TMA_STORE, EXP_EARLY.value,
            sm90_common.PAD_NARROW, sm90_common.PAD_MODE, sm90_common.SOFTCAP_APPROX.value)


_BOUND: dict = {}  # ``attn_bwd_sm90``'s kept launches (``BIND``), by the op's signature


def _tma_writable(t: torch.Tensor, varlen: bool) -> bool:
    """Whether a gradient can be stored through a [rows, heads * d] TMA descriptor (the op
    layer's fresh outputs always can): the checks the inputs' descriptors pass."""
    return tma_view_problem("", t, varlen) is None and base_problem("", t) is None


def _order(grid: tuple[int, int], p: AttnParams, device: torch.device) -> int:
    """A (blocks, batch * heads) grid's head_group (``_key_block``, ``query_tile``): grouped
    heaviest-first with ``LPT`` under a causal / local mask (one CTA a SM), else 1 (one head
    after another). Without a mask every block costs the same and the grouped order timed
    1% slower (d=128 2k / 4k, alternated runs; benchmarks/NOTES.md, session 16)."""
    if not (LPT and p.causal_like):
        return 1
    return head_group_size(grid[1], grid[0], sm_count(device))


def _dq_block_n(head_dim: int) -> int:
    # d = 256: 32-key K/V tiles keep the dQ kernel's shared memory at 192 KB with 2 stages
    return 32 if head_dim == 256 else DQ_BLOCK_N


"""Hopper (sm90) attention forward in Gluon: the FlashAttention-3 design.

One CTA computes a 128-row query tile of one (sequence, head) with three warp-specialized roles:
- a 1-warp producer (24 registers) that issues TMA loads: the two 64-row halves of the Q tile once,
  then K and V tiles through a ring of shared-memory stages, each guarded by a "full" mbarrier
  (TMA transaction bytes) and "empty" mbarriers (released by both consumers: K's as soon as
  QKᵀ has read it, V's after PV), so the next K streams in while PV runs;
- two consumer warpgroups (240 registers each, via setmaxnreg), one per 64-row half, running async
  wgmma: S = Q·Kᵀ from shared memory, softmax in registers, O += P·V with P kept in registers
  (the "RS" form). Within a warpgroup, QKᵀ of block j is issued before PV of block j-1 and retired
  first (``warpgroup_mma_wait(1)``), so the softmax of block j runs while PV_{j-1} is on the tensor
  cores; the two warpgroups' instruction streams interleave on the SM.

Layout: host-side TMA descriptors over the row-major views [rows, heads * head_dim] of q, k, v and
out (batched [b, s, h, d] tensors are the varlen case with equal lengths, rows = b * s). Rows read
past a sequence's end belong to the next sequence (or are zero past the tensor); their scores are
masked and their outputs never stored. A varlen tensor may be longer than cu_seqlens[-1], and rows
of no sequence may hold NaN (torch.empty): the producer zeroes them in the last V tile, since a
masked P of 0 times NaN is still NaN (``sm90_common.zero_tail_rows``). The epilogue stores O
through TMA when the 64-row half lies inside the sequence, with masked stores otherwise.

The same kernel reads paged KV caches (``attn_fwd_sm90_paged``, chunked prefill through
``flash_attn_with_kvcache``): the producer looks pages up in the block table and issues one TMA
copy per page run into row slices of the stage's tile.

Semantics are the portable kernel's (``triton_fwd.py``): bottom-right causal/window masks, LSE in
natural log, rows with no visible key give out 0 and LSE -inf. ``unsupported_reason`` lists what
this kernel does not cover; dispatch then uses the portable kernel ('auto') or raises ('sm90').
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
from ioattn.dense.sm90_common import (OPERAND_DTYPES, PADDED_HEAD_DIMS, barriers, base_problem,
                                      invalidate, query_tile, query_tile_at, key_tiles,
                                      rows_descriptor, score_scales, softcap_tanh, box_cols,
                                      store_cols, tile_layout, tma_load, stage_tma_store,
                                      tma_view_problem, grouped_order, head_group_size,
                                      mma_over_cols, narrow_dv, pow2_floor,
                                      wgmma_a_operand, wgmma_acc_layout, zero_last_key_tile)
from ioattn.dispatch import sm_count
from ioattn.launch import Desc, current_stream, launcher, repeat

HALF_M = gl.constexpr(64)  # query rows per consumer warpgroup (wgmma's M)
BLOCK_M = gl.constexpr(128)  # two consumer warpgroups
SUPPORTED_HEAD_DIMS = (64, 128, 256)
CONSUMER_REGS = 240
PRODUCER_REGS = 24
# pingpong between the consumer warpgroups (``_take_turn``): IOATTN_SM90_PINGPONG=1 / 0 forces it
# on / off; by default on where it measured faster (``_pingpong``)
PINGPONG = os.environ.get("IOATTN_SM90_PINGPONG", "auto")
# persistent CTAs for batched problems (``_consumer_persistent``), IOATTN_SM90_PERSISTENT:
# "auto" (default) takes the dynamic form (tiles handed out by an atomic counter, FA3's dynamic
# scheduler) at d in {64, 128}, where it measured faster on the H200 than one CTA per tile
# (results/sm90_fwd_persistent_snake0_*.json, results/tune/sm90_fwd_persdynamic_*.log: d=128
# +2-12% non-causal, level to +2% causal; d=64 against three warpgroups +3-15% at 2k-4k, -3% at
# 16k non-causal); d=256 was not measured and keeps one CTA per tile. "dynamic" forces it; "1" / "static" the static snake
# order (slower under causal masks: 476 vs 608 at d=128 16k); "0" turns persistence off.
PERSISTENT_MODE = os.environ.get("IOATTN_SM90_PERSISTENT", "auto").lower()
# the dynamic scheduler's tiles (and the one-CTA-per-tile grid's: d=256, varlen) in grouped
# heaviest-first order (default; IOATTN_SM90_FWD_LPT=0 the old order;
# ``sm90_common.grouped_order``): heads in groups of about a wave of tiles, each
# group's heaviest tiles of every head first, so the launch ends on light tiles. The old order
# (one head after another, heaviest first) ends on the last head's heavy tiles: simulated for
# the FA grid's causal shapes, 3-7% over the ideal at 2k-8k. Timed on / off (session 16,
# results/lpt{1,0}_*_b1d4228*): causal d=128 +4-6% at 2k-16k, d=64 +0-4%; d=256 at 8k in
# alternated runs 731 / 724 against 681 / 687 TFLOP/s without a mask, 647 / 641 against
# 604 / 600 causal (results/tune/lpt_d256_8k_*_a1337ee_*)
LPT = os.environ.get("IOATTN_SM90_FWD_LPT", "1").lower() in ("1", "true", "on")
# (the persistent forward) each tile's O staged in its last V stage (free once both warpgroups'
# last P·V retired; its release to the producer waits for the store) and stored by TMA, instead
# of from the wgmma registers in 4-byte pieces (a persistent CTA's Q buffer may already hold the
# next tile's Q). The backward's dK / dV stores from registers took 4.2-4.8 us a CTA (session
# 18's timeline); here O is 16 KB a warpgroup at d=128. Needs 64 rows of V's tile a consumer
# warpgroup (d=128, and d=64 on two warpgroups: causal below 4k). On by default: the stamped
# d=128 2k kernel 493 -> 442 us non-causal, 288 -> 266 causal, the tile 30.1 -> 27.3 / 18.2 ->
# 16.9 us (results/tune/fwd_timeline_o_tma*_ebb00c7_*); timed on / off (results/fwd_o_tma{1,0}
# _ebb00c7_*.json, only the "on" run beside cuDNN, which favoured it by up to ~10% in cells it
# does not reach) d=128 +4% / +5% non-causal at 2k / 4k, +17% / +13% causal at 2k / 8k; in the
# runs of record the causal d=128 forward +3-7% (dense_229fd66_* against dense_a1337ee_*).
# IOATTN_SM90_FWD_O_TMA=0 turns it off
O_TMA = os.environ.get("IOATTN_SM90_FWD_O_TMA", "1").lower() in ("1", "true", "on")
# (with O_TMA) the stage goes back to the producer once the next tile's first key block is done
# instead of after a wait for the store at the end of the tile (its 1.4-1.8 us, stamped, a 27 us
# d=128 2k tile, results/tune/fwd_timeline_o_tma1_*_ebb00c7_*). The producer needs that stage
# again for the next tile's third V block. Stamped d=128 2k kernel 440.5 -> 438.0 us non-causal,
# 269.0 -> 262.4 causal (results/tune/fwd_timeline_o_defer{1,0}_*_e33e22c_*); timed on / off
# with cuDNN in both runs, d=128 causal 2k +6%, the other d = 64 / 128 cells within the runs'
# ~2-4% (results/fwd_o_defer{1,0}_e33e22c_*.json). IOATTN_SM90_FWD_O_DEFER=0 turns it off
O_DEFER = os.environ.get("IOATTN_SM90_FWD_O_DEFER", "1").lower() in ("1", "true", "on")
# The batched / varlen forward's launches kept for repeats (``launch.Bound``, ``_BOUND``): a
# repeat of a call's form (shapes, strides, alignments, dtypes, scalars and the launch form) is
# one C call with its q / k / v / o descriptors encoded at the call's addresses, past
# ``launch_form``'s rules but not the launcher's per-call signature, the descriptors' building
# and Triton's wrapper. On by default since its GPU tests passed on the H200 and an eager
# call's host time fell from 145-181 to 125 us there (off / on in one process)
# (results/tune/host_overhead_4528809_nvidia-h200_2026-12-07.json; the sm90 decode's run() fell
# from 199 to 79 us so, results/tune/host_bound_e287008_*). IOATTN_SM90_FWD_BIND=0 turns it off
BIND = os.environ.get("IOATTN_SM90_FWD_BIND", "1").lower() not in ("0", "false", "off")
# The dynamic scheduler's tile counter kept per stream and zeroed by each launch's last CTA
# (``_tile_counter``, ``_release_counter``), instead of a new one allocated and zeroed by the
# host per call: torch.zeros took ~30 us of the eager call's host time under cProfile on the
# H100 machine (results/tune/host_graph_short_sm90_113e7bd_nvidia-h100_2026-12-07.log), host
# time the 512 cells pay in full (benchmarks/NOTES.md, sessions 37-39). On by default since its
# GPU test and the whole GPU suite with it on passed on the H100 (914 passed,
# results/tune/tests_gpu_counters1_bwdbind1_c0cc029_*.log); the eager call's host time there
# 49.9 / 70.0 us non-causal / causal against 57.9 / 59.1 off (one process, ~10 us of noise:
# results/tune/host_overhead_c0cc029_*.json), its eager-to-replay gap at d=128 512 5.0-5.3 us
# against 7.5-7.7 (results/tune/host_graph_counters{1,0}_c0cc029_*).
# IOATTN_SM90_FWD_STREAM_COUNTERS=0 takes a new counter a call
STREAM_COUNTERS = os.environ.get("IOATTN_SM90_FWD_STREAM_COUNTERS", "1").lower() in (
    "1", "true", "on")
# (the persistent forward at d = 64 / 128) Q in two buffers, taken by the tiles in turn. With
# one, the producer, having issued a tile's last K/V loads, waits until that tile's last QKᵀ
# has retired before it loads the next tile's Q, and the next tile's first K/V loads queue
# behind that Q load, so at each tile boundary the consumers wait out a load's latency (Q's,
# and K's for the first block) after the last block's softmax, P·V and O store. With two, the
# producer goes on into the next tile as soon as ring stages free up, its Q into the other
# buffer (freed by the tile before), about STAGES blocks ahead. A few % of a short tile (d=64
# causal 2k: ~8 key blocks a tile), by the shape of the numbers; to be stamped
# (benchmarks/timeline.py's q_wait) and timed. Shared memory: at d=64 a second Q takes 16 KB
# (24 KB on the 192-row tile) beside 96 KB of stages; at d=128 Q and three stages already take
# 224 KB, so two Q buffers go with two stages (192 KB).
# Stamped at 2k (session 23, cf359b1): d=128 kernel -2.7% causal, -3% non-causal, the tiles
# overlapping at the boundary; timed with cuDNN in one run, d = 64 / 128 2k-8k: better in 10 of
# 12 cells (d=64 causal 4k +4.7%, d=128 4k +3%), 16k ~1.5-2.5% worse in all four (long tiles,
# the boundary a small share, and d=128's third stage missed). So "auto" (the default): two Q
# buffers when max_seqlen_k <= Q_BUFS_MAX_SEQLEN_K, one beyond; IOATTN_SM90_FWD_Q_BUFS=1 / 2
# forces one or two. Timed again (session 24, be5d13b, results/fwd_q_bufs{2,1}_be5d13b_*.json,
# cuDNN beside each): d=64 causal +2.5 / +3.6 / +3% at 2k / 4k / 8k, d=128 -1% to +2%, but
# d=64 non-causal -4 / -5 / -10% (session 23: +3 / -1 / -1.6%): "auto" keeps one buffer there
# (``_two_q``)
Q_BUFS = os.environ.get("IOATTN_SM90_FWD_Q_BUFS", "auto").lower()
if Q_BUFS not in ("1", "2", "auto"):
    raise ValueError(f"IOATTN_SM90_FWD_Q_BUFS={Q_BUFS!r}: expected 1, 2 or auto")
Q_BUFS_MAX_SEQLEN_K = 8192
# (Tried and removed, session 23: each tile's first K and V loaded before the wait for its Q
# buffer, one Q buffer. Stamped at 2k it changed nothing, d=64 causal 392.5 -> 394.8 us,
# d=128 261.7 -> 263.4 causal, 436.0 -> 437.1 non-causal: Q's wait at the tile start was
# already 0.1-0.2 us; the boundary's cost is the last block's drain, which two Q buffers hide.)
# three consumer warpgroups at d=64 (192-row tiles, FA3's shape there); on by default since it
# measured 1.03-1.05x the two-warpgroup form non-causal from 2k and 1.23x causal at 2k on the
# H200 (results/sm90_fwd_wg3_{1,0}_*.json; causal 4k-16k within 3%), IOATTN_SM90_FWD_WG3=0 turns
# it off. Environment switches are read at import (``dispatch.ENV_SWITCHES``)
WG3 = os.environ.get("IOATTN_SM90_FWD_WG3", "1").lower() not in ("0", "false", "off")
# three consumer warpgroups on 64-key tiles in the persistent form too (d=64 batched problems,
# where the dynamic scheduler otherwise runs two, or the 192x128 tile, ``_wide``): measured and
# left opt-in (README, "Hopper fast path")
WG3_PERSISTENT = os.environ.get("IOATTN_SM90_WG3_PERSISTENT", "0").lower() in ("1", "true", "on")
# keys per tile of the three-warpgroup forms (``_wide``, ``_tile``): "auto" (default) takes
# FlashAttention-3's d=64 tile, 192 x 128, for batched causal problems from 4k queries, where
# it ran 1.02-1.14x the two-warpgroup persistent default on the H200 (401 / 473 / 480 against
# 394 / 414 / 442 TFLOP/s at 4k / 8k / 16k, results/tune/sm90_fwd_wg3pp_{wide,default}_29beb84_*.log;
# at 2k 331 against 349; non-causal 0.76-0.80x), even though its causal form spills ~410 B at
# 160 registers; in the next run of record 457 / 511 at 8k / 16k against 423 / 433 in the one
# before (results/dense_{7484f8a,700c91d}_*.json); "64" never takes it, "128" takes it for
# every d=64 forward (three warpgroups then, persistent or not)
WG3_BLOCK_N = os.environ.get("IOATTN_SM90_WG3_BLOCK_N", "auto").lower()
# fp8 (e4m3) q, k, v on this kernel (FlashAttention-3's fp8 forward: QGMMA on e4m3 operands, V's
# tiles keys innermost, P scaled by 2^8 and rounded to e4m3 in registers), for batched calls with
# per-head descales (``fp8_unsupported_reason``); block descales and varlen are opt-in below. On
# by default since its GPU tests passed on an H100 (56 fp8 tests,
# results/tune/tests_fp8_all_a5d54e7_*) and it ran 1.1-1.4x the portable fp8 forward there at
# d = 128 / 256 (``fp8_preferred``); IOATTN_SM90_FP8=0 keeps fp8 calls on the portable kernel
FP8_ON = os.environ.get("IOATTN_SM90_FP8", "1").lower() in ("1", "true", "on")
# (with FP8_ON) block descales (one per 128 rows, ``ioattn.fp8.quantize``'s default, the
# mission's block quantization) on the sm90 fp8 forward too: Q's one a tile, K's folded into
# each key block's score scale, V's by rescaling the accumulator as the block changes (as the
# portable kernel). Opt-in (IOATTN_SM90_FP8_BLOCK=1) until its GPU tests have run: built and
# compile-checked on CPU only (session 42)
FP8_BLOCK_ON = os.environ.get("IOATTN_SM90_FP8_BLOCK", "0").lower() in ("1", "true", "on")
# (with FP8_ON) varlen fp8 calls (cu_seqlens) on the sm90 fp8 forward too: V viewed [heads_k *
# d_v, total_k] keys innermost, a sequence's keys from its cu_seqlens_k offset, the last V tile's
# keys past the sequence zeroed in shared memory (``zero_tail_cols``) as the 16-bit forms zero
# rows. Opt-in (IOATTN_SM90_FP8_VARLEN=1) until its GPU tests have run (built on CPU, session 43)
FP8_VARLEN_ON = os.environ.get("IOATTN_SM90_FP8_VARLEN", "0").lower() in ("1", "true", "on")
# (with FP8_ON) batched fp8 calls on persistent CTAs (one an SM, tiles drawn from the dynamic
# scheduler's counter in grouped heaviest-first order, as the 16-bit forms; O from registers, one
# Q buffer). Opt-in (IOATTN_SM90_FP8_PERSISTENT=1) until timed against one CTA a tile (built on
# CPU, session 43)
FP8_PERSISTENT = os.environ.get("IOATTN_SM90_FP8_PERSISTENT", "0").lower() in ("1", "true", "on")
if WG3_BLOCK_N not in ("auto", "64", "128"):
    raise ValueError(f"IOATTN_SM90_WG3_BLOCK_N={WG3_BLOCK_N!r}: expected auto, 64 or 128")


# Q's first columns held in registers as the Q·Kᵀ wgmma's A operand (the rest from shared memory,
# ``_qk``): each key block's shared-memory reads lose Q's share of them (d=128 with all of Q:
# 32 of 160 KB a 128-key block; d=256 with 64 of its columns: 16 of 192 KB a 64-key block, the
# d=256 forward's QKᵀ being the one at shared memory's 128 B a cycle). Opt-in
# (IOATTN_SM90_FWD_Q_REGS=1: d=128 all of Q, with the exponentials early (``EXP_EARLY``) where
# there is no mask, which the unmasked form needs to compile without spills; d=256 64 columns;
# d=64's 160-register tiles spill with it) until timed (built on CPU, session 43: compiled
# spill-free in the key loops at d=128 causal / non-causal early and d=256). With all of Q in
# registers (d=128, persistent) its one buffer is released as soon as it is loaded, so the
# producer loads the next tile's Q under this tile's blocks, as two buffers do (``Q_BUFS``)
# without taking a ring stage for it. The fp8 forms take all of Q at every head dim
# (``_fp8_form``; e4m3 Q at d=256 is 32 registers a thread): fp8 d=256's Q·Kᵀ (m64n64k32, 4 KB
# in 32 cycles) is at 128 B a cycle too, and Q is a third of its reads a key block
Q_REGS_ON = os.environ.get("IOATTN_SM90_FWD_Q_REGS", "0").lower() in ("1", "true", "on")
# the steady state's exponentials before the wait for PV_{j-1} (FA3's intra-warpgroup overlap as
# written, ``_softmax_step`` with OP_LAYOUT), P converted to PV's register operand in the same
# block: in the sm90 SASS ptxas otherwise hoists that wait above ~56 of a thread's 66
# exponentials per 128-key block, so they run after PV_{j-1} instead of under it. Spills stay
# or fall in every form (converting early frees P's fp32 registers before the wait): the 192x128
# tile 412 -> 124 B causal, 8 -> 0 non-causal; d=128 causal persistent 68 -> 0.
# IOATTN_SM90_FWD_EXP_EARLY: "auto" (default) on the 192x128 tile without a mask only, where it
# measured 1.16-1.18x the default form at d=64 from 4k on the H200 (511 / 504 / 510 TFLOP/s at 4k
# / 8k / 16k against 435 / 436 / 438, results/sm90_fwd_exp_early{1_wide,0}_5952fd0_*.json): it is what
# made that tile slow without a mask (0.76-0.80x before); on the tile's causal form it ran
# 0.96-0.99x and on the other forms -8% to +8% by cell with no consistent sign, so they keep the
# wait's own order; "1" / "0" force it on / off everywhere
EXP_EARLY_MODE = os.environ.get("IOATTN_SM90_FWD_EXP_EARLY", "auto").lower()
if EXP_EARLY_MODE in ("true", "on"):
    EXP_EARLY_MODE = "1"
if EXP_EARLY_MODE in ("false", "off"):
    EXP_EARLY_MODE = "0"
if EXP_EARLY_MODE not in ("auto", "1", "0"):
    raise ValueError(f"IOATTN_SM90_FWD_EXP_EARLY={EXP_EARLY_MODE!r}: expected auto, 1 or 0")


def _block_n(head_dim: int) -> int:
    # d=256: the 64x256 fp32 accumulator takes 128 of a consumer's 240 registers
    return 64 if head_dim == 256 else 128


def _pingpong(head_dim: int, wgs: int) -> bool:
    # H200, two warpgroups, pingpong on vs off in one session
    # (results/sm90_fwd_pp{0,1_run1,1_run2}_*.json): d=256 non-causal +2-4% from 4k, d=128 within
    # noise to -2% at 8k-16k, d=64 -1-2%. Three warpgroups (d=64) take their turns round robin
    # (FA3's warp-scheduler barrier at d=64) only when forced: 0.95-1.00x without them
    # (results/sm90_fwd_wg3pp_{pp3p,wg3p}_29beb84_*.json)
    if PINGPONG == "auto":
        return head_dim == 256 and wgs == 2
    return PINGPONG != "0"


def _wide(head_dim: int, varlen: bool, mask: str, max_seqlen_q: int) -> bool:
    """Whether the d=64 forward takes three warpgroups on 128-key tiles (``WG3_BLOCK_N``);
    mask is "none", "causal" or "window"."""
    if head_dim != 64 or not WG3 or WG3_BLOCK_N == "64":
        return False
    if WG3_BLOCK_N == "128":
        return True
    if not _persistent(64, varlen):
        return False
    if mask == "none":  # (with its exponentials early, ``EXP_EARLY_MODE``)
        return max_seqlen_q >= 2048 and EXP_EARLY_MODE != "0"
    return mask == "causal" and max_seqlen_q >= 4096


def _exp_early(head_dim: int, wide: bool, mask: str) -> bool:
    """Whether the forward's exponentials go before the wait for PV_{j-1} (``EXP_EARLY_MODE``)."""
    if EXP_EARLY_MODE == "auto":
        return head_dim == 64 and wide and mask == "none"
    return EXP_EARLY_MODE == "1"


def _wgs(head_dim: int, varlen: bool, wide: bool = False) -> int:
    # consumer warpgroups: 3 at d=64 when WG3 asks for it (persistent: on the wide tile, or when
    # WG3_PERSISTENT asks too), else 2 (the paged forward always runs 2)
    if head_dim == 64 and WG3 and (wide or WG3_PERSISTENT or not _persistent(head_dim, varlen)):
        return 3
    return 2


def _tile(head_dim: int, wgs: int, wide: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, STAGES, consumer registers) of the forward. Three 4-warp consumers and the
    producer's warpgroup share 64K registers: 3 x 128 x 160 + 128 x 24 = 64512 (the default
    partition, consumer 0, gets what the workers leave), so at 160 registers the 64x128 S tile
    of 128-key tiles spills in most forms (350-410 B; 8 B persistent non-causal): three
    warpgroups take 64-key tiles (spill-free) and 4 stages (90 KB of shared memory), or
    (``wide``) FlashAttention-3's 128-key tiles and 3 stages (123 KB)."""
    if wgs == 3:
        return (128, 3, 160) if wide else (64, 4, 160)
    return _block_n(head_dim), _stages(head_dim), CONSUMER_REGS


def _stages(head_dim: int) -> int:
    # shared memory: Q 2x64xD + STAGES x (K + V) BLOCK_NxD, 2 bytes each (<= 227 KB on sm90:
    # d=128 with 3 stages takes 224 KB, d=256 with 2 stages 192 KB)
    return 2 if head_dim == 256 else 3


@gluon.jit
def _key_tile_load(desc, tile, bar, BT, bt_row, bt_width, key0, col, PAGED: gl.constexpr,
                   PAGE: gl.constexpr):
    """TMA loads of a K or V tile, keys [key0, key0 + rows of ``tile``): rows key0.. of ``desc``'s
    view, or (PAGED) from a paged cache viewed as [pages * PAGE, heads * d] rows: one copy per
    page run of ``desc``'s box (the page, or the whole tile when pages are larger), at row page *
    PAGE + key % PAGE, page = BT[bt_row + key // PAGE]. Page-table entries past the row's width
    read as page 0 (keys there are past the sequence, masked and zeroed); TMA zero-fills rows
    outside the cache."""
    if PAGED:
        BOX: gl.constexpr = desc.block_type.shape[0]
        for i in gl.static_range(tile.shape[0] // BOX):
            key = key0 + i * BOX
            idx = key // PAGE
            page = gl.load(BT + bt_row + idx, mask=idx < bt_width, other=0)
            tma.async_copy_global_to_shared(desc, [page * PAGE + key % PAGE, col], bar,
                                            tile.slice(i * BOX, BOX, dim=0))
    else:
        tma_load(desc, key0, col, bar, tile)


@gluon.jit
def _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_full, v_full,
                  k_empty, v_empty, v_fixed, BT, bt_row, bt_width, q_row, q_col, k_row, kv_col,
                  n_tiles, n_keys, it0, tc, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr,
                  PAGED: gl.constexpr, PAGE: gl.constexpr, PERSISTENT: gl.constexpr,
                  Q_BUFS: gl.constexpr = 1, q_base=0, vt_row=0, vt_key0=0):
    """The loads of one query tile: its Q pieces (into q_smem's q_base.., of Q_BUFS buffers),
    then its n_tiles K and V tiles through the ring from ring position it0 (a persistent CTA's
    running count of key tiles); tc counts the CTA's earlier tiles with work that used this Q
    buffer (q_empty's phase). fp8: V's descriptor views it keys innermost (``_v_rows``;
    ``ioattn.fp8.keys_contiguous``): its tiles are at row vt_row (the head's first), keys
    (columns) from vt_key0 (the tile's first key: varlen, a column of the packed total_k)."""
    V_T: gl.constexpr = v_smem.dtype.is_fp8()
    # V's column: kv_col is K's (a head's first column at K's tile width)
    if V_T or _v_cols(v_smem) == k_smem.shape[2]:
        v_col = kv_col
    else:
        v_col = kv_col // k_smem.shape[2] * _v_cols(v_smem)
    # no key block: the consumers never wait for Q (and, non-persistent, reuse its buffers to
    # stage O), so Q must not be in flight then
    has_work = n_tiles > 0
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    BOX: gl.constexpr = k_desc.block_type.shape[0]  # rows per TMA copy: BLOCK_N, or a page
    if PERSISTENT:
        # the consumers free Q once the previous tile's last QKᵀ has retired
        mbarrier.wait(q_empty, (tc & 1) ^ 1, pred=has_work)
    WGS: gl.constexpr = q_smem.shape[0] // Q_BUFS  # consumer warpgroups: a Q piece each
    mbarrier.expect(q_bar, WGS * q_desc.block_type.nbytes, pred=has_work)
    for i in gl.static_range(WGS):
        tma_load(q_desc, q_row + i * HALF_M, q_col, q_bar, q_smem.index(q_base + i),
                 pred=has_work)
    for j in range(n_tiles):
        it = it0 + j
        st = it % STAGES
        ph = ((it // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(st), ph)
        mbarrier.expect(k_full.index(st), (BLOCK_N // BOX) * k_desc.block_type.nbytes)
        _key_tile_load(k_desc, k_smem.index(st), k_full.index(st), BT, bt_row, bt_width,
                       k_row + j * BLOCK_N, kv_col, PAGED, PAGE)
        mbarrier.wait(v_empty.index(st), ph)
        if V_T:
            mbarrier.expect(v_full.index(st), v_desc.block_type.nbytes)
            tma_load(v_desc, vt_row, vt_key0 + j * BLOCK_N, v_full.index(st), v_smem.index(st))
        else:
            mbarrier.expect(v_full.index(st), (BLOCK_N // BOX) * v_desc.block_type.nbytes)
            _key_tile_load(v_desc, v_smem.index(st), v_full.index(st), BT, bt_row, bt_width,
                           k_row + j * BLOCK_N, v_col, PAGED, PAGE)
    if IS_VARLEN or PAGED:
        # (one tile per CTA: these modes do not run persistent) the last V tile may run past the
        # last packed sequence into rows of no sequence (or, in a paged cache, into page slots
        # past the sequence: stale entries): zero them (their P is 0, but 0 * NaN is not) before
        # the consumers' P·V reads the tile
        zero_last_key_tile(v_full, v_fixed, v_smem, v_smem, n_tiles, n_keys, STAGES, False, V_T)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_full, v_full,
              k_empty, v_empty, v_fixed, BT, bt_row, bt_width, q_row, q_col, k_row, kv_col, n_tiles,
              n_keys, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr, PAGED: gl.constexpr,
              PAGE: gl.constexpr, vt_row=0, vt_key0=0):
    _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_full, v_full,
                  k_empty, v_empty, v_fixed, BT, bt_row, bt_width, q_row, q_col, k_row, kv_col,
                  n_tiles, n_keys, 0, 0, STAGES, IS_VARLEN, PAGED, PAGE, False, 1, 0, vt_row,
                  vt_key0)


@gluon.jit
def _snake(t, total):
    """The persistent CTAs' tile order: CTA p takes tiles p, p + G, ... (G CTAs), each round of G
    consecutive tiles dealt in the opposite direction to the last (a snake draft), so that under
    a causal mask, where tiles run heaviest first within each head, no CTA keeps drawing the
    heavy end: simulated on the FA grid's causal shapes, the busiest CTA's load over the mean
    fell from 1.08-1.21 (plain striding) to 1.03 (1.57 -> 1.48 at 16k with 16 heads, where a
    round is about one head). Rounds keep consecutive tiles together (one head's K/V in L2)."""
    G = gl.num_programs(0)
    r = t // G
    i = t - r * G
    width = gl.minimum(G, total - r * G)
    return t + (r % 2) * (width - 1 - 2 * i)


@gluon.jit
def _produce_persistent_tile(t, it, tc, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar,
                             q_empty, k_full, v_full, k_empty, v_empty, v_fixed, BT, CU_Q, CU_K,
                             n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed, n_m, window_left,
                             window_right, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                             HAS_RIGHT: gl.constexpr, Q_BUFS: gl.constexpr = 1):
    """The loads of tile t (query tiles fastest, heaviest first); returns the CTA's updated key
    tile count (ring position) and count of tiles with work (q_empty's phase). Q_BUFS == 2:
    q_smem holds two Q buffers, q_bar / q_empty a barrier each, taken by tiles with work in
    turn."""
    HEAD_D: gl.constexpr = q_smem.shape[2]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    WGS: gl.constexpr = q_smem.shape[0] // Q_BUFS
    TILE_M: gl.constexpr = WGS * HALF_M  # 64 rows per consumer warpgroup
    (off_b, off_h, off_hk, q_start, seqlen_q, k_start, seqlen_k, lse_start, start_m, lo,
     n_tiles) = query_tile_at(n_m - 1 - t % n_m, t // n_m, CU_Q, CU_K, n_heads, kv_group,
                              seqlen_q_fixed, seqlen_k_fixed, window_left, window_right,
                              TILE_M, BLOCK_N, False, HAS_LEFT, HAS_RIGHT)
    vt_row = 0
    if v_smem.dtype.is_fp8():
        vt_row = _v_rows(off_b, off_hk, n_heads // kv_group, v_smem.shape[1], False)
    _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar.index(tc % Q_BUFS),
                  q_empty.index(tc % Q_BUFS), k_full, v_full, k_empty, v_empty, v_fixed, BT, 0, 0,
                  q_start + start_m, off_h * HEAD_D, k_start + lo, off_hk * HEAD_D, n_tiles,
                  seqlen_k - lo, it, tc // Q_BUFS, STAGES, False, False, 1, True, Q_BUFS,
                  tc % Q_BUFS * WGS, vt_row, lo)
    return it + n_tiles, tc + (n_tiles > 0).to(gl.int32)


@gluon.jit
def _static_tile(k, total):
    """A persistent CTA's k-th tile in the static order: tile program_id + k * programs in snake
    order (``_snake``), or ``total`` once past the last (the end of the loop)."""
    t0 = gl.program_id(0) + k * gl.num_programs(0)
    t = total
    if t0 < total:
        t = _snake(t0, total)
    return t


@gluon.jit
def _producer_next_tile(k, total, COUNTER, tile_smem, tile_full, tile_empty,
                        DYNAMIC: gl.constexpr, n_m=1, head_group=1):
    """The producer's k-th tile: static order, or (DYNAMIC) the CTA's own first tile and then
    ids drawn from the launch's counter, each handed to the consumers (``_publish_tile``; an id
    >= total ends their loop too)."""
    if DYNAMIC:
        t = gl.program_id(0)
        if k > 0:
            t = gl.num_programs(0) + gl.atomic_add(COUNTER, 1, sem="relaxed", scope="gpu")
        if head_group != 1:  # the id of the t-th tile in grouped heaviest-first order
            if t < total:
                rank, bh = grouped_order(t, n_m, head_group)
                t = bh * n_m + rank
        _publish_tile(tile_smem, tile_full, tile_empty, t, k)
    else:
        t = _static_tile(k, total)
    return t


@gluon.jit
def _release_counter(COUNTER):
    """(dynamic scheduling, after the CTA's partitions have joined: its producer has drawn its
    last id) COUNTER [2] int32, ids drawn and CTAs done, zero at the launch's start: the last
    CTA to finish zeroes both for the next launch on the stream (``_tile_counter``)."""
    if gl.atomic_add(COUNTER + 1, 1, sem="acq_rel", scope="gpu") == gl.num_programs(0) - 1:
        gl.store(COUNTER, 0)
        gl.store(COUNTER + 1, 0)


@gluon.jit
def _consumer_next_tile(k, total, tile_smem, tile_full, tile_empty, DYNAMIC: gl.constexpr):
    """A consumer warpgroup's k-th tile: the static order, or (DYNAMIC) the producer's k-th id."""
    if DYNAMIC:
        t = _read_tile(tile_smem, tile_full, tile_empty, k)
    else:
        t = _static_tile(k, total)
    return t


@gluon.jit
def _publish_tile(tile_smem, tile_full, tile_empty, t, k):
    """(dynamic scheduling) The producer hands tile id t, its k-th, to the consumers through a
    2-slot shared-memory ring."""
    slot = k % 2
    mbarrier.wait(tile_empty.index(slot), ((k // 2) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile_smem.index(slot).store(gl.full([1], t, gl.int32, layout))
    mbarrier.arrive(tile_full.index(slot), count=1)


@gluon.jit
def _read_tile(tile_smem, tile_full, tile_empty, k):
    """(dynamic scheduling) A consumer warpgroup's k-th tile id."""
    slot = k % 2
    mbarrier.wait(tile_full.index(slot), (k // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    t = gl.max(tile_smem.index(slot).load(layout), axis=0)
    gl.thread_barrier()  # every warp has read the slot before the warpgroup's one arrival
    mbarrier.arrive(tile_empty.index(slot), count=1)
    return t


@gluon.jit
def _producer_persistent(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_full,
                         v_full, k_empty, v_empty, v_fixed, BT, CU_Q, CU_K, n_heads, kv_group,
                         seqlen_q_fixed, seqlen_k_fixed, n_bh, window_left, window_right,
                         COUNTER, tile_smem, tile_full, tile_empty,
                         STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                         DYNAMIC: gl.constexpr, head_group=1, Q_BUFS: gl.constexpr = 1):
    # DYNAMIC: tiles handed out by an atomic counter as CTAs free up (FA3's dynamic persistent
    # scheduler), in the same heaviest-first order, each id passed to the consumers through
    # shared memory; otherwise a static snake order (``_snake``). q_bar / q_empty: Q_BUFS
    # barriers each (``_produce_persistent_tile``)
    n_m = gl.cdiv(seqlen_q_fixed, q_smem.shape[0] // Q_BUFS * HALF_M)
    total = n_m * n_bh
    it = n_bh * 0  # key tiles loaded so far (ring position)
    tc = n_bh * 0  # tiles with work so far (q_empty's phase)
    k = n_bh * 0  # this CTA's tiles so far
    t = _producer_next_tile(k, total, COUNTER, tile_smem, tile_full, tile_empty, DYNAMIC, n_m,
                            head_group)
    while t < total:
        it, tc = _produce_persistent_tile(
            t, it, tc, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_full,
            v_full, k_empty, v_empty, v_fixed, BT, CU_Q, CU_K, n_heads, kv_group, seqlen_q_fixed,
            seqlen_k_fixed, n_m, window_left, window_right, STAGES, HAS_LEFT, HAS_RIGHT, Q_BUFS)
        k += 1
        t = _producer_next_tile(k, total, COUNTER, tile_smem, tile_full, tile_empty, DYNAMIC,
                                n_m, head_group)


@gluon.jit
def _exp_step(s, m_i, m_use, l_i, qk_scale_log2, OP_DTYPE: gl.constexpr,
              OP_LAYOUT: gl.constexpr, P_SHIFT: gl.constexpr = 0):
    # P_SHIFT (fp8): P scaled by 2^P_SHIFT before its e4m3 rounding, so that small
    # probabilities keep their bits (FlashAttention-3's); l carries the factor, _finish's LSE
    # takes it out
    if P_SHIFT:
        p = gl.exp2(s * qk_scale_log2 - (m_use - P_SHIFT)[:, None])
    else:
        p = gl.exp2(s * qk_scale_log2 - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    if OP_LAYOUT is not None:  # P as PV's register operand already (its fp32 form dies here)
        p = gl.convert_layout(p.to(OP_DTYPE), OP_LAYOUT)
    return p, alpha, l_new


@gluon.jit
def _softmax_step(s, m_i, l_i, col0, row0, seqlen_k, off, window_left, window_right, qk_scale_log2,
                  HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, OP_DTYPE: gl.constexpr = None,
                  OP_LAYOUT: gl.constexpr = None, P_SHIFT: gl.constexpr = 0):
    """One key block's online-softmax update in the log2 domain (scores = s * qk_scale_log2).

    Returns (p, alpha, m_new, l_new); p unnormalized (with OP_LAYOUT: already PV's OP_DTYPE
    register operand), alpha the rescale of the running sums.
    With OP_LAYOUT: the exponentials inside the masked / unmasked branches, so they end a basic block
    that the wait for PV_{j-1} follows: ptxas schedules within blocks, and after the join it
    hoists that wait above most of them (``_exp_early``).
    """
    s_layout: gl.constexpr = s.type.layout
    ROWS: gl.constexpr = s.shape[0]
    BLOCK_N: gl.constexpr = s.shape[1]
    need_mask = col0 + BLOCK_N > seqlen_k
    if HAS_RIGHT:
        need_mask = need_mask | (col0 + BLOCK_N - 1 > row0 + off + window_right)
    if HAS_LEFT:
        need_mask = need_mask | (col0 < row0 + ROWS - 1 + off - window_left)
    if need_mask:
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        vis = cols[None, :] < seqlen_k
        if HAS_RIGHT:
            vis = vis & (cols[None, :] <= rows[:, None] + off + window_right)
        if HAS_LEFT:
            vis = vis & (cols[None, :] >= rows[:, None] + off - window_left)
        s = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale_log2)
        # a row that has seen no key keeps m = -inf: shift by 0 so exp2 sees -inf, not NaN
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        if OP_LAYOUT is not None:
            p, alpha, l_new = _exp_step(s, m_i, m_use, l_i, qk_scale_log2, OP_DTYPE, OP_LAYOUT,
                                        P_SHIFT)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale_log2)
        m_use = m_new
        if OP_LAYOUT is not None:
            p, alpha, l_new = _exp_step(s, m_i, m_use, l_i, qk_scale_log2, OP_DTYPE, OP_LAYOUT,
                                        P_SHIFT)
    if OP_LAYOUT is None:
        p, alpha, l_new = _exp_step(s, m_i, m_use, l_i, qk_scale_log2, OP_DTYPE, OP_LAYOUT,
                                    P_SHIFT)
    return p, alpha, m_new, l_new


FP8_P_SHIFT = gl.constexpr(8)  # (fp8) P's scale before its rounding, a power of two (``_exp_step``)


@gluon.constexpr_function
def _p_shift(dtype):
    """P's scale exponent for operands of ``dtype`` (``_exp_step``'s P_SHIFT): fp8's, else 0."""
    return FP8_P_SHIFT if dtype.is_fp8() else 0


@gluon.constexpr_function
def _operand_bits(dtype):
    return dtype.primitive_bitwidth


@gluon.constexpr_function
def _v_cols(v_smem):
    """V's (and O's) tile width from its ring: [stages, keys, d_v], or (fp8) keys innermost,
    [stages, d_v, keys], the K-major operand fp8 wgmma takes (``_v_operand``)."""
    return v_smem.shape[1] if v_smem.dtype.is_fp8() else v_smem.shape[2]


@gluon.jit
def _v_operand(v_smem, st):
    """Stage st of the V ring as P·V's [keys, d_v] operand (fp8: the transposed view of its
    keys-innermost tile)."""
    if v_smem.dtype.is_fp8():
        return v_smem.index(st).permute((1, 0))
    else:
        return v_smem.index(st)


FP8_BLOCK = gl.constexpr(128)  # (fp8 block descales) rows a descale covers, ioattn.fp8's


@gluon.jit
def _scores(s, qk_scale_log2, softcap_scale, kd):
    """A key block's raw Q·Kᵀ after softcap's tanh (``softcap_tanh``), and the softmax's score
    scale for it; kd (fp8 block descales): the block's K descale, which scales the raw scores
    (into softcap's scale when capped, else the score scale); None: none."""
    if kd is not None:  # (a product of two guarded descales can be 0 again)
        if softcap_scale is None:
            qk_scale_log2 = _live_descale(qk_scale_log2 * kd)
        else:
            softcap_scale = _live_descale(softcap_scale * kd)
    return softcap_tanh(s, softcap_scale), qk_scale_log2


@gluon.jit
def _fp8_tile_descales(QD, KD, VD, stride_qdb, stride_qdh, stride_qdk, stride_kdb, stride_kdh,
                       stride_vdb, stride_vdh, qd_group, off_b, off_h, off_hk, start_m,
                       DS_BLOCKED: gl.constexpr):
    """(fp8) A tile's descales: (d_qk, o_scale, KDB, VDB), d_qk Q's (its rows' block) times K's
    (per head; DS_BLOCKED: Q's only, K's read per key block from KDB), which the caller folds
    into the score scale, or softcap's when capped, through ``_live_descale`` (a tuple with
    softcap's None does not compile); o_scale V's (per head; DS_BLOCKED: 1, V's read per key
    block from VDB); KDB / VDB 0 when not DS_BLOCKED (warp_specialize takes no None)."""
    d_qk = gl.load(QD + off_b * stride_qdb + (off_h // qd_group) * stride_qdh
                   + (start_m // FP8_BLOCK) * stride_qdk)
    o_scale = 1.0
    KDB = 0
    VDB = 0
    if DS_BLOCKED:
        KDB = KD + off_b * stride_kdb + off_hk * stride_kdh
        VDB = VD + off_b * stride_vdb + off_hk * stride_vdh
    else:
        d_qk = d_qk * gl.load(KD + off_b * stride_kdb + off_hk * stride_kdh)
        o_scale = gl.load(VD + off_b * stride_vdb + off_hk * stride_vdh)
    return d_qk, o_scale, KDB, VDB


@gluon.jit
def _v_rows(off_b, off_hk, n_heads_k, HEAD_DV: gl.constexpr, IS_VARLEN: gl.constexpr):
    """(fp8) The first row of a (batch, KV head)'s V in its keys-innermost view: [batch *
    heads_k * d_v, seqlen_k] batched, [heads_k * d_v, total_k] varlen (a sequence's keys are
    then columns from its cu_seqlens_k offset)."""
    if IS_VARLEN:
        return off_hk * HEAD_DV
    else:
        return (off_b * n_heads_k + off_hk) * HEAD_DV


@gluon.jit
def _live_descale(d):
    """(fp8) A score descale (Q's times K's, or the score scale with it) of 0 as 1e-30: the
    scores it scales are 0 either way, but masked ones stay -inf (-inf x 0 is NaN)."""
    return gl.where(d == 0.0, 1e-30, d)


@gluon.jit
def _block_descale(DB, stride_dk, col0, valid=True):
    """(fp8 block descales) the descale of the key block at col0 (1 where not valid: past the
    tile's last block, not read)."""
    return gl.load(DB + (col0 // FP8_BLOCK) * stride_dk, mask=valid, other=1.0)


@gluon.jit
def _v_descale_step(vd, v_cur, p):
    """(fp8 block descales of V) The accumulator holds O over the current block's descale
    v_cur; a block of descale vd rescales it by v_cur / vd before its P·V adds in (returned as
    a factor for alpha's multiply) and becomes current. A descale of 0 (a block of zeros)
    leaves v_cur and zeroes the block's P (its keys still count in l). Returns (v_cur, factor,
    p)."""
    live = vd > 0
    factor = gl.where(live, v_cur / gl.where(live, vd, 1.0), 1.0)
    if not live:  # (a uniform branch, though ptxas if-converts it into selects over P)
        p = gl.zeros_like(p)
    return gl.where(live, vd, v_cur), factor, p


@gluon.jit
def _pv_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, EARLY: gl.constexpr):
    """P as PV's register operand (EARLY: ``_softmax_step`` converted it already)."""
    if EARLY:
        return p
    else:
        return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _take_turn(turn, WG: gl.constexpr, r, PINGPONG: gl.constexpr):
    """Pingpong (FA3): the consumer warpgroups issue their wgmmas in turns, round robin, so one's
    softmax runs while the others' GEMMs keep the tensor cores busy (without an order they wait
    for the same K tile, issue together and then do their softmax together, leaving the tensor
    cores idle). Round r of warpgroup WG waits for phase r of its turn barrier: the last
    warpgroup completes warpgroup 0's phase 0 before its first round (``_first_turn``), and each
    warpgroup passes the turn to the next once it has issued a round's wgmmas. A barrier is at
    most one phase ahead of its waiter: the next pass to it needs this one's."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), r & 1)


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index((WG + 1) % turn.shape[0]), count=1)


@gluon.jit
def _first_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG and WG == turn.shape[0] - 1:
        mbarrier.arrive(turn.index(0), count=1)  # warpgroup 0 issues first


@gluon.jit
def _store_rows(O, out, o_base_off, stride_om, row0, seqlen_q, O_COLS: gl.constexpr):
    """Masked stores of a warpgroup's [64, d] output rows from registers (rows < seqlen_q; and
    columns < O_COLS, O's own head dim, when the tile is zero-padded past it; 0: all)."""
    o_layout: gl.constexpr = out.type.layout
    rows_o = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, out.shape[1], layout=gl.SliceLayout(0, o_layout))
    ptrs = O + o_base_off + rows_o[:, None].to(gl.int64) * stride_om + cols_o[None, :]
    store_cols(ptrs, out, (rows_o < seqlen_q)[:, None], cols_o, O_COLS)


@gluon.jit
def _consume_tile(q_smem, k_smem, v_smem, q_bar, q_empty, k_full, v_full, k_empty, v_empty,
                  v_fixed, turn, start_m, seqlen_q, seqlen_k, lo, n_tiles, window_left,
                  window_right, qk_scale_log2, softcap_scale, it0, rnd0, q_phase, pend,
                  WG: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, ZERO_TAIL: gl.constexpr, PINGPONG: gl.constexpr,
                  PERSISTENT: gl.constexpr, EXP_EARLY: gl.constexpr, QK_COLS: gl.constexpr = 0,
                  KEEP_LAST_V: gl.constexpr = 0, q_base=0, q_bufs_empty=None, o_scale=1.0,
                  KDB=0, VDB=0, stride_kdk=0, stride_vdk=0, DS_BLOCKED: gl.constexpr = False,
                  Q_REGS: gl.constexpr = 0):
    """One warpgroup's 64 query rows of a tile: key tiles from ring position it0, pingpong rounds
    from rnd0, Q (q_smem's piece q_base + WG) from its load completing phase q_phase of q_bar.
    Returns (out, lse): out normalized in the input dtype, lse in natural log; rows that saw no
    key give out 0 and LSE -inf.
    KEEP_LAST_V (``O_TMA``): the last V stage is not released here (the caller stages O in it);
    2: and pend (V stage + 1, or 0) is the previous tile's, whose O store is released once this
    tile's first block is done, or at once without key blocks (``_release_o_stage``); 3: O goes
    to this tile's Q buffer instead (two Q buffers, q_bufs_empty their barriers), so Q's buffer,
    not a V stage, is released late: pend is the previous tile's Q buffer + 1.
    Q_REGS: Q's first Q_REGS columns loaded into registers after Q's wait, Q·Kᵀ's register
    operand (``_qk``); all of Q in the persistent form with one buffer: the buffer released
    right after that load (Q_FREED_EARLY), not after the tile's last Q·Kᵀ.
    fp8 operands (e4m3 Q, K and V, V's tiles keys innermost): out in bf16, times o_scale (V's
    descale); the descales of Q and K are in qk_scale_log2 / softcap_scale. DS_BLOCKED: K's and
    V's descales by key block (KDB / VDB pointers, read per block: ``_steady_blocks``), O times
    the last live block's V descale."""
    HEAD_DV: gl.constexpr = _v_cols(v_smem)  # V's and O's tile width (Q / K's may differ)
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = wgmma_acc_layout(BLOCK_N, _operand_bits(dtype))
    o_layout: gl.constexpr = wgmma_acc_layout(HEAD_DV, _operand_bits(dtype))
    p_layout: gl.constexpr = wgmma_a_operand(o_layout, _operand_bits(dtype))
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    q = q_smem.index(q_base + WG)
    # (persistent, one Q buffer, all of Q in registers: released once loaded)
    Q_FREED_EARLY: gl.constexpr = PERSISTENT and KEEP_LAST_V != 3 and Q_REGS == q.shape[1]
    if KEEP_LAST_V == 3:  # where the previous tile's O went: a Q buffer or a V stage
        o_bars = q_bufs_empty
    else:
        o_bars = v_empty
    row0 = start_m + WG * HALF_M  # first query row (within the sequence) of this warpgroup
    off = seqlen_k - seqlen_q
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([HALF_M], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([HALF_M, HEAD_DV], gl.float32, layout=o_layout)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)

    v_cur = 1.0  # (fp8 block descales of V) the accumulator's: the current block's
    if DS_BLOCKED:
        v_cur = (n_tiles * 0).to(gl.float32) + 1.0
    if n_tiles > 0:
        mbarrier.wait(q_bar, q_phase)
        q_regs = None  # (Q_REGS) Q's first columns as the Q·Kᵀ wgmma's register operand
        if Q_REGS:
            q_regs = q.slice(0, Q_REGS, 1).load(wgmma_a_operand(s_layout, _operand_bits(dtype)))
        if Q_FREED_EARLY:  # all of Q is in registers: its buffer goes back at once, so the
            # producer loads the next tile's Q while this one runs (one buffer, as two); every
            # warp's reads done first (the arrive is one thread's)
            gl.thread_barrier()
            mbarrier.arrive(q_empty, count=1)
        kd = None
        vd0 = None
        if DS_BLOCKED:  # (block 0's, both read before its Q·Kᵀ)
            kd = _block_descale(KDB, stride_kdk, lo)
            vd0 = _block_descale(VDB, stride_vdk, lo)
        # prologue: S_0 and its softmax (EXP_EARLY: P carried as PV's register operand)
        p, m_i, l_i = _first_block(q, k_smem, k_full, k_empty, turn, s_zero, m_i, l_i, it0, rnd0, lo,
                                   row0, seqlen_k, off, window_left, window_right,
                                   qk_scale_log2,
                                   softcap_scale, WG, STAGES, HAS_LEFT, HAS_RIGHT, PINGPONG,
                                   EXP_EARLY, QK_COLS, kd, q_regs)
        if DS_BLOCKED:  # (acc is 0: no rescale)
            v_cur, _, p = _v_descale_step(vd0, v_cur, p)
        if KEEP_LAST_V >= 2:
            _release_o_stage(o_bars, pend)
        p, acc, m_i, l_i, v_cur = _steady_blocks(q, k_smem, v_smem, k_full, v_full, k_empty,
                                                 v_empty, turn, p, acc, m_i, l_i, it0, rnd0,
                                                 n_tiles, lo, row0, seqlen_k, off, window_left,
                                                 window_right, qk_scale_log2,
                                                 softcap_scale, WG, STAGES, HAS_LEFT, HAS_RIGHT,
                                                 PINGPONG, EXP_EARLY, QK_COLS, KDB, VDB,
                                                 stride_kdk, stride_vdk, v_cur, DS_BLOCKED,
                                                 q_regs)
        if PERSISTENT and KEEP_LAST_V != 3 and not Q_FREED_EARLY:
            # every QKᵀ of this tile has retired: the producer may load the next tile's Q
            mbarrier.arrive(q_empty, count=1)
        # tail: PV of the last block
        last_it = it0 + n_tiles - 1
        last = last_it % STAGES
        mbarrier.wait(v_full.index(last), (last_it // STAGES) & 1)
        if ZERO_TAIL:
            if lo + n_tiles * BLOCK_N > seqlen_k:  # the producer zeroes rows past the end
                mbarrier.wait(v_fixed, 0)
        p_op = _pv_operand(p, dtype, p_layout, EXP_EARLY)
        _take_turn(turn, WG, rnd0 + n_tiles, PINGPONG)
        acc_tok = warpgroup_mma(p_op, _v_operand(v_smem, last), acc, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=[acc_tok])
        if not KEEP_LAST_V or KEEP_LAST_V == 3:
            mbarrier.arrive(v_empty.index(last), count=1)
    elif KEEP_LAST_V >= 2:  # no key block: the previous tile's O stage goes back now
        _release_o_stage(o_bars, pend)
    if dtype.is_fp8():
        if DS_BLOCKED:
            o_scale = v_cur
        return _finish(acc, m_i, l_i, gl.bfloat16, o_scale, FP8_P_SHIFT)
    else:
        return _finish(acc, m_i, l_i, dtype)


@gluon.jit
def _release_o_stage(bars, pend):
    """(O_TMA == 2, 3) A V stage (or, 3, a Q buffer) holding a previous tile's O (pend: its
    index + 1; 0: none) back to the producer through its barrier in ``bars`` once the TMA store
    has read it: released a block into the next tile rather than waited for at the store, so
    the store's read overlaps that block."""
    if pend > 0:
        tma.store_wait(0)
        mbarrier.arrive(bars.index(pend - 1), count=1)


@gluon.jit
def _qk(q, q_regs, k, s_zero, QK_COLS: gl.constexpr):
    """S = Q·Kᵀ of a key block, asynchronous: Q from shared memory (``mma_over_cols``), or
    (q_regs, ``Q_REGS``) its first columns from registers and the rest from shared memory: one
    wgmma group (all of Q in registers) to three into one accumulator (the first with A in
    registers: its shared-memory reads are K's alone). Returns the last group's token (groups
    complete in order, so a wait that retires it retires them all)."""
    if q_regs is None:
        tok = mma_over_cols(q, k, s_zero, QK_COLS)
    else:
        R: gl.constexpr = q_regs.shape[1]
        D: gl.constexpr = q.shape[1]
        gl.static_assert(R >= 16 and R <= D and R == pow2_floor(R),
                         "Q_REGS: a power of two of 16 columns up to d")
        tok = warpgroup_mma(q_regs, k.slice(0, R, 1).permute((1, 0)), s_zero, use_acc=False,
                            is_async=True)
        # the rest in power-of-two pieces, each at an offset its size divides (a slice of a
        # swizzled tile must be): [R, D) whole, or [R, 2R) and [2R, D)
        C0: gl.constexpr = D - R if R == D or D - R == pow2_floor(D - R) else R
        if C0 > 0:
            tok = warpgroup_mma(q.slice(R, C0, 1), k.slice(R, C0, 1).permute((1, 0)), tok,
                                use_acc=True, is_async=True)
        if R + C0 < D:
            tok = warpgroup_mma(q.slice(R + C0, D - R - C0, 1),
                                k.slice(R + C0, D - R - C0, 1).permute((1, 0)), tok,
                                use_acc=True, is_async=True)
    return tok


@gluon.jit
def _steady_blocks(q, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn, p, acc, m_i, l_i,
                   it0, rnd0, n_tiles, lo, row0, seqlen_k, off, window_left, window_right,
                   qk_scale_log2, softcap_scale, WG: gl.constexpr, STAGES: gl.constexpr,
                   HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, PINGPONG: gl.constexpr,
                   EARLY: gl.constexpr, QK_COLS: gl.constexpr = 0, KDB=0, VDB=0,
                   stride_kdk=0, stride_vdk=0, v_cur=1.0, DS_BLOCKED: gl.constexpr = False,
                   q_regs=None):
    """Key blocks 1 .. n_tiles - 1 of a tile (block 0's softmax done, its P in p), the steady
    state: QK_j issued before PV_{j-1}; wait(1) retires QK_j, the softmax of block j then
    overlaps PV_{j-1}. Returns (p, acc, m_i, l_i, v_cur): the last block's P, its PV not issued.
    (DS_BLOCKED: fp8 block descales) KDB / VDB: K's / V's descales of this (batch, head), by key
    block (stride_kdk / stride_vdk), each read a block ahead; v_cur: the accumulator's V
    descale (``_v_descale_step``)."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32,
                      layout=wgmma_acc_layout(BLOCK_N, _operand_bits(q.dtype)))
    kd = None
    vd = None
    if DS_BLOCKED:
        kd = _block_descale(KDB, stride_kdk, lo + BLOCK_N, n_tiles > 1)
        vd = _block_descale(VDB, stride_vdk, lo + BLOCK_N, n_tiles > 1)
    for j in range(1, n_tiles):
        p, alpha, m_i, l_i, acc = _block_step(q, k_smem, v_smem, k_full, v_full, k_empty,
                                              v_empty, turn, s_zero, p, acc, m_i, l_i, it0 + j, rnd0 + j,
                                              lo + j * BLOCK_N, row0, seqlen_k, off, window_left,
                                              window_right, qk_scale_log2,
                                              softcap_scale, WG, STAGES, HAS_LEFT,
                                              HAS_RIGHT, PINGPONG, EARLY, QK_COLS, kd, q_regs)
        if DS_BLOCKED:  # (the next block's K descale, read while this one's work runs)
            kd = _block_descale(KDB, stride_kdk, lo + (j + 1) * BLOCK_N, j + 1 < n_tiles)
            v_cur, factor, p = _v_descale_step(vd, v_cur, p)
            alpha = alpha * factor
            vd = _block_descale(VDB, stride_vdk, lo + (j + 1) * BLOCK_N, j + 1 < n_tiles)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    return p, acc, m_i, l_i, v_cur


@gluon.jit
def _first_block(q, k_smem, k_full, k_empty, turn, s_zero, m_i, l_i, it, rnd, col0, row0,
                 seqlen_k, off,
                 window_left, window_right, qk_scale_log2, softcap_scale, WG: gl.constexpr,
                 STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                 PINGPONG: gl.constexpr, EARLY: gl.constexpr, QK_COLS: gl.constexpr = 0,
                 kd=None, q_regs=None):
    """A tile's first key block (ring position it, keys from col0) with no PV in flight: S on
    its own, then its softmax from (m_i, l_i). Returns (p, m, l); with EARLY p is PV's register
    operand already (``_softmax_step``). kd: the block's K descale (fp8 block descales)."""
    dtype: gl.constexpr = q.dtype
    p_layout: gl.constexpr = wgmma_a_operand(wgmma_acc_layout(q.shape[1], _operand_bits(dtype)),
                                             _operand_bits(dtype))
    st = it % STAGES
    mbarrier.wait(k_full.index(st), (it // STAGES) & 1)
    _take_turn(turn, WG, rnd, PINGPONG)
    s_tok = _qk(q, q_regs, k_smem.index(st), s_zero, QK_COLS)
    _pass_turn(turn, WG, PINGPONG)
    s, qk_scale_log2 = _scores(warpgroup_mma_wait(0, deps=[s_tok]), qk_scale_log2,
                               softcap_scale, kd)
    mbarrier.arrive(k_empty.index(st), count=1)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, col0, row0, seqlen_k, off, window_left,
                                       window_right, qk_scale_log2, HAS_LEFT, HAS_RIGHT,
                                       dtype if EARLY else None, p_layout if EARLY else None,
                                       _p_shift(dtype))
    return p, m_i, l_i


@gluon.jit
def _block_step(q, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn, s_zero, p, acc, m_i,
                l_i, it, rnd, col0, row0, seqlen_k, off, window_left, window_right, qk_scale_log2,
                softcap_scale,
                WG: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                HAS_RIGHT: gl.constexpr, PINGPONG: gl.constexpr, EARLY: gl.constexpr,
                QK_COLS: gl.constexpr = 0, kd=None, q_regs=None):
    """One steady-state step: QK of the block at ring position it (keys from col0) issued, then
    PV of the previous block (its P in p, V at it - 1) into acc; wait(1) retires QK, and this
    block's softmax from (m_i, l_i) runs while PV is on the tensor cores. Returns (p, alpha, m,
    l, acc), acc not yet rescaled by alpha; s_zero: S's zero accumulator, made once. kd: the
    block's K descale (fp8 block descales)."""
    dtype: gl.constexpr = q.dtype
    p_layout: gl.constexpr = wgmma_a_operand(acc.type.layout, _operand_bits(dtype))
    st = it % STAGES
    prev = (it - 1) % STAGES
    mbarrier.wait(k_full.index(st), (it // STAGES) & 1)
    mbarrier.wait(v_full.index(prev), ((it - 1) // STAGES) & 1)
    p_op = _pv_operand(p, dtype, p_layout, EARLY)
    _take_turn(turn, WG, rnd, PINGPONG)
    s_tok = _qk(q, q_regs, k_smem.index(st), s_zero, QK_COLS)  # (QK_COLS, q_regs: 1-3 groups)
    acc_tok = warpgroup_mma(p_op, _v_operand(v_smem, prev), acc, is_async=True)
    _pass_turn(turn, WG, PINGPONG)
    s, qk_scale_log2 = _scores(warpgroup_mma_wait(1, deps=[s_tok]), qk_scale_log2,
                               softcap_scale, kd)
    mbarrier.arrive(k_empty.index(st), count=1)  # K is consumed: the producer refills it
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, col0, row0, seqlen_k, off, window_left,
                                       window_right, qk_scale_log2, HAS_LEFT, HAS_RIGHT,
                                       dtype if EARLY else None, p_layout if EARLY else None,
                                       _p_shift(dtype))
    acc = warpgroup_mma_wait(0, deps=[acc_tok])
    mbarrier.arrive(v_empty.index(prev), count=1)  # the previous block's V is consumed
    return p, alpha, m_i, l_i, acc


@gluon.jit
def _finish(acc, m_i, l_i, dtype: gl.constexpr, o_scale=None, P_SHIFT: gl.constexpr = 0):
    """(out, lse) of a warpgroup's rows: out = acc / l in dtype, lse in natural log; rows that
    saw no key give out 0 and LSE -inf. (fp8) o_scale: V's descale; P_SHIFT: P's scale
    exponent, in l (``_exp_step``)."""
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse_log2 = m_i + gl.log2(l_safe)
    if P_SHIFT:
        lse_log2 = lse_log2 - P_SHIFT
    lse = gl.where(empty, float("-inf"), lse_log2 * 0.6931471805599453)
    inv_l = 1.0 / l_safe
    if o_scale is not None:
        inv_l = inv_l * o_scale
    out = (acc * gl.convert_layout(inv_l, row_o)[:, None]).to(dtype)
    return out, lse


@gluon.jit
def _store_lse(LSE, lse, lse_off, row0, seqlen_q):
    rows_s = row0 + gl.arange(0, HALF_M, layout=lse.type.layout)
    gl.store(LSE + lse_off + rows_s, lse, mask=rows_s < seqlen_q)


@gluon.jit
def _consumer(o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar, q_empty, k_full, v_full, k_empty,
              v_empty, v_fixed, turn, o_row, o_col, o_base_off, stride_om, lse_off, start_m,
              seqlen_q, seqlen_k, lo, n_tiles, window_left, window_right, qk_scale_log2,
              softcap_scale,
              WG: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
              ZERO_TAIL: gl.constexpr, PINGPONG: gl.constexpr, EXP_EARLY: gl.constexpr,
              O_COLS: gl.constexpr, QK_COLS: gl.constexpr = 0, o_scale=1.0, KDB=0,
              VDB=0, stride_kdk=0, stride_vdk=0, DS_BLOCKED: gl.constexpr = False,
              Q_REGS: gl.constexpr = 0):
    _first_turn(turn, WG, PINGPONG)
    out, lse = _consume_tile(q_smem, k_smem, v_smem, q_bar, q_empty, k_full, v_full, k_empty,
                             v_empty, v_fixed, turn, start_m, seqlen_q, seqlen_k, lo, n_tiles,
                             window_left, window_right, qk_scale_log2,
                             softcap_scale, 0, 0, 0, 0, WG, STAGES,
                             HAS_LEFT, HAS_RIGHT, ZERO_TAIL, PINGPONG, False, EXP_EARLY, QK_COLS,
                             0, 0, None, o_scale, KDB, VDB, stride_kdk, stride_vdk,
                             DS_BLOCKED, Q_REGS)
    row0 = start_m + WG * HALF_M
    _store_lse(LSE, lse, lse_off, row0, seqlen_q)
    # (fp8: the Q half, e4m3, holds half of a bf16 O: O goes from registers)
    if row0 + HALF_M <= seqlen_q and not q_smem.dtype.is_fp8():
        o_smem = q_smem.index(WG)  # the Q half is dead: stage O there for the TMA store
        if out.shape[1] != q_smem.shape[2]:  # (V / O narrower than Q / K: O's own tile there)
            o_smem = o_smem._reinterpret(out.dtype, [HALF_M, out.shape[1]],
                                         tile_layout(o_desc.layout))
        stage_tma_store(o_desc, o_row + WG * HALF_M, o_col, o_smem, out)
        tma.store_wait(0)
    else:
        _store_rows(O, out, o_base_off, stride_om, row0, seqlen_q, O_COLS)


@gluon.jit
def _consume_persistent_tile(t, it, tc, rnd, pend, o_desc, O, LSE, q_smem, k_smem, v_smem,
                             q_bar, q_empty, k_full, v_full, k_empty, v_empty, v_fixed, o_bar, turn,
                             CU_Q, CU_K, stride_om, stride_oh, stride_lb, stride_lh, n_heads,
                             kv_group, seqlen_q_fixed, seqlen_k_fixed, n_m, window_left,
                             window_right, qk_scale_log2, softcap_scale, WG: gl.constexpr,
                             STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                             HAS_RIGHT: gl.constexpr, PINGPONG: gl.constexpr,
                             EXP_EARLY: gl.constexpr, O_COLS: gl.constexpr,
                             QK_COLS: gl.constexpr = 0, O_TMA: gl.constexpr = 0,
                             Q_BUFS: gl.constexpr = 1, QD=0, KD=0, VD=0, stride_qdb=0,
                             stride_qdh=0, stride_qdk=0, stride_kdb=0, stride_kdh=0,
                             stride_kdk=0, stride_vdb=0, stride_vdh=0, stride_vdk=0,
                             qd_group=1, DS_BLOCKED: gl.constexpr = False,
                             Q_REGS: gl.constexpr = 0):
    """One warpgroup's rows of tile t; returns the updated ring position, tiles-with-work count,
    pingpong rounds and (O_TMA >= 2) the V stage (3: Q buffer) + 1 whose O store is still to be
    released.
    Q_BUFS == 2: Q in two buffers taken in turn (``_produce_persistent_tile``).
    fp8: the tile's descales (``_fp8_tile_descales``; QD.. as the kernel takes them) read here,
    Q's and K's into the score scale, V's into O."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    WGS: gl.constexpr = q_smem.shape[0] // Q_BUFS
    TILE_M: gl.constexpr = WGS * HALF_M
    start_m = (n_m - 1 - t % n_m) * TILE_M
    lo, n_tiles = key_tiles(start_m, TILE_M, seqlen_q_fixed, seqlen_k_fixed, window_left,
                            window_right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    o_scale = 1.0
    KDB = 0
    VDB = 0
    if q_smem.dtype.is_fp8():
        off_b = t // n_m // n_heads
        off_h = t // n_m % n_heads
        d_qk, o_scale, KDB, VDB = _fp8_tile_descales(
            QD, KD, VD, stride_qdb, stride_qdh, stride_qdk, stride_kdb, stride_kdh, stride_vdb,
            stride_vdh, qd_group, off_b, off_h, off_h // kv_group, start_m, DS_BLOCKED)
        if softcap_scale is None:
            qk_scale_log2 = _live_descale(qk_scale_log2 * d_qk)
        else:
            softcap_scale = _live_descale(softcap_scale * d_qk)
    out, lse = _consume_tile(q_smem, k_smem, v_smem, q_bar.index(tc % Q_BUFS),
                             q_empty.index(tc % Q_BUFS), k_full, v_full, k_empty, v_empty,
                             v_fixed, turn, start_m, seqlen_q_fixed, seqlen_k_fixed, lo, n_tiles,
                             window_left, window_right, qk_scale_log2, softcap_scale, it, rnd,
                             (tc // Q_BUFS) & 1, pend, WG, STAGES, HAS_LEFT, HAS_RIGHT, False,
                             PINGPONG, True, EXP_EARLY, QK_COLS, O_TMA, tc % Q_BUFS * WGS,
                             q_empty, o_scale, KDB, VDB, stride_kdk, stride_vdk, DS_BLOCKED,
                             Q_REGS)
    pend = _store_tile(out, lse, t, o_desc, O, LSE, v_smem, v_empty, o_bar,
                       (it + n_tiles - 1) % STAGES, tc, CU_Q, CU_K, stride_om, stride_oh,
                       stride_lb, stride_lh, n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed,
                       n_m, window_left, window_right, WG, TILE_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                       O_COLS, O_TMA, q_smem, tc % Q_BUFS)
    has_work = (n_tiles > 0).to(gl.int32)
    return it + n_tiles, tc + has_work, rnd + has_work * (n_tiles + 1), pend


@gluon.jit
def _store_tile(out, lse, t, o_desc, O, LSE, v_smem, v_empty, o_bar, last, tc, CU_Q, CU_K,
                stride_om, stride_oh, stride_lb, stride_lh, n_heads, kv_group, seqlen_q_fixed,
                seqlen_k_fixed, n_m, window_left, window_right,
                WG: gl.constexpr, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr,
                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, O_COLS: gl.constexpr,
                O_TMA: gl.constexpr, q_smem=None, q_buf=0):
    """A persistent CTA's store of a warpgroup's rows of tile t: the output offsets recomputed
    here rather than kept live through the key loop. Q's buffer may already hold the next
    tile's Q, so O is stored from registers, or (O_TMA, a tile with key blocks) staged in the
    tile's last V stage (``last``, which its consumer kept) once every warpgroup's last P·V has
    read it (o_bar, phase from tc, the CTA's tiles with work so far) and stored by TMA; that
    stage goes back to the producer after the store has read it (O_TMA == 2: once the next
    tile's first block is done, ``_release_o_stage``). O_TMA == 3 (two Q buffers): staged in
    the warpgroup's own piece of the tile's Q buffer q_buf instead (its QKᵀ reads are over, and
    no other warpgroup reads that piece: no o_bar), the buffer released as the stage is at 2.
    Returns the stage (3: Q buffer) + 1 still to be released (O_TMA >= 2), or 0."""
    (off_b, off_h, off_hk, q_start, seqlen_q, k_start, seqlen_k, lse_start, start_m, lo,
     n_tiles) = query_tile_at(n_m - 1 - t % n_m, t // n_m, CU_Q, CU_K, n_heads, kv_group,
                              seqlen_q_fixed, seqlen_k_fixed, window_left, window_right,
                              TILE_M, BLOCK_N, False, HAS_LEFT, HAS_RIGHT)
    row0 = start_m + WG * HALF_M
    WGS: gl.constexpr = TILE_M // HALF_M
    _store_lse(LSE, lse, off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh
               + lse_start, row0, seqlen_q)
    o_off = q_start.to(gl.int64) * stride_om + off_h.to(gl.int64) * stride_oh
    pend = n_tiles * 0
    if O_TMA == 3:
        if n_tiles > 0:
            if row0 + HALF_M <= seqlen_q:  # (a partial half would run into the next sequence)
                gl.static_assert(out.shape[1] == q_smem.shape[2], "O staged in Q's tile")
                stage_tma_store(o_desc, q_start + row0, off_h * out.shape[1],
                                q_smem.index(q_buf * WGS + WG), out)
            else:
                _store_rows(O, out, o_off, stride_om, row0, seqlen_q, O_COLS)
            pend = q_buf + 1  # (released after the next tile's first block, store or not)
        else:
            _store_rows(O, out, o_off, stride_om, row0, seqlen_q, O_COLS)
    elif O_TMA:
        if n_tiles > 0:
            mbarrier.arrive(o_bar, count=1)
            mbarrier.wait(o_bar, tc & 1)
            if row0 + HALF_M <= seqlen_q:  # (a partial half would run into the next sequence)
                o_all = v_smem.index(last)._reinterpret(out.dtype, [WGS, HALF_M, out.shape[1]],
                                                        tile_layout(o_desc.layout))
                stage_tma_store(o_desc, q_start + row0, off_h * out.shape[1], o_all.index(WG),
                                out)
                if O_TMA == 2:
                    pend = last + 1
                else:
                    tma.store_wait(0)
                    mbarrier.arrive(v_empty.index(last), count=1)
            else:
                _store_rows(O, out, o_off, stride_om, row0, seqlen_q, O_COLS)
                mbarrier.arrive(v_empty.index(last), count=1)
        else:
            _store_rows(O, out, o_off, stride_om, row0, seqlen_q, O_COLS)
    else:
        _store_rows(O, out, o_off, stride_om, row0, seqlen_q, O_COLS)
    return pend


@gluon.jit
def _consumer_persistent(o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar, q_empty, k_full, v_full,
                         k_empty, v_empty, v_fixed, turn, CU_Q, CU_K, stride_om, stride_oh,
                         stride_lb, stride_lh, n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed,
                         n_bh, window_left, window_right, qk_scale_log2,
                         softcap_scale, tile_smem, tile_full,
                         tile_empty, o_bar, WG: gl.constexpr,
                         STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                         PINGPONG: gl.constexpr, DYNAMIC: gl.constexpr,
                         EXP_EARLY: gl.constexpr, O_COLS: gl.constexpr,
                         QK_COLS: gl.constexpr = 0, O_TMA: gl.constexpr = 0,
                         Q_BUFS: gl.constexpr = 1, QD=0, KD=0, VD=0, stride_qdb=0,
                         stride_qdh=0, stride_qdk=0, stride_kdb=0, stride_kdh=0, stride_kdk=0,
                         stride_vdb=0, stride_vdh=0, stride_vdk=0, qd_group=1,
                         DS_BLOCKED: gl.constexpr = False, Q_REGS: gl.constexpr = 0):
    """A persistent CTA's tiles, in the producer's order: program_id, program_id + programs, ...
    in snake order (``_snake``), or (DYNAMIC) the ids the producer draws from the tile counter
    and passes on through shared memory; tiles run over (query tile, batch * head), query tiles
    fastest (a head's tiles run together, sharing K/V in L2) and heaviest (last) first."""
    n_m = gl.cdiv(seqlen_q_fixed, q_smem.shape[0] // Q_BUFS * HALF_M)
    total = n_m * n_bh
    _first_turn(turn, WG, PINGPONG)
    it = n_bh * 0  # key tiles consumed so far (ring position)
    tc = n_bh * 0  # tiles with work so far (q_bar's phase)
    rnd = n_bh * 0  # pingpong rounds so far
    k = n_bh * 0  # this CTA's tiles so far
    pend = n_bh * 0  # (O_TMA >= 2) a V stage (3: Q buffer) + 1 whose O store is still to be
    # released
    t = _consumer_next_tile(k, total, tile_smem, tile_full, tile_empty, DYNAMIC)
    while t < total:
        it, tc, rnd, pend = _consume_persistent_tile(
            t, it, tc, rnd, pend, o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar, q_empty, k_full,
            v_full, k_empty, v_empty, v_fixed, o_bar, turn, CU_Q, CU_K, stride_om, stride_oh,
            stride_lb, stride_lh, n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed, n_m,
            window_left, window_right, qk_scale_log2,
            softcap_scale, WG, STAGES, HAS_LEFT, HAS_RIGHT, PINGPONG, EXP_EARLY, O_COLS,
            QK_COLS, O_TMA, Q_BUFS, QD, KD, VD, stride_qdb, stride_qdh, stride_qdk, stride_kdb,
            stride_kdh, stride_kdk, stride_vdb, stride_vdh, stride_vdk, qd_group, DS_BLOCKED,
            Q_REGS)
        k += 1
        t = _consumer_next_tile(k, total, tile_smem, tile_full, tile_empty, DYNAMIC)
    if O_TMA >= 2:
        tma.store_wait(0)  # the last tile's O store has read its stage (3: Q buffer)


@gluon.jit
def _attn_fwd_sm90(q_desc, k_desc, v_desc, o_desc, O, LSE, CU_Q, CU_K, BT,
                   stride_om, stride_oh, stride_lb, stride_lh, stride_btb, bt_width,
                   n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed, n_bh,
                   qk_scale_log2, window_left, window_right,
                   IS_VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                   STAGES: gl.constexpr, CONSUMER_REGS_: gl.constexpr,
                   PRODUCER_REGS_: gl.constexpr, BLOCK_N: gl.constexpr, PAGED: gl.constexpr,
                   PAGE: gl.constexpr, PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr,
                   WGS: gl.constexpr = 2,
                   DYNAMIC: gl.constexpr = False, COUNTER=None, EXP_EARLY: gl.constexpr = False,
                   softcap_scale=None, O_COLS: gl.constexpr = 0, head_group=1,
                   QK_COLS: gl.constexpr = 0, O_TMA: gl.constexpr = False,
                   Q_BUFS: gl.constexpr = 1, COUNTER_RESET: gl.constexpr = False,
                   QD=None, KD=None, VD=None, stride_qdb=0, stride_qdh=0, stride_kdb=0,
                   stride_kdh=0, stride_vdb=0, stride_vdh=0, qd_group=1, stride_qdk=0,
                   stride_kdk=0, stride_vdk=0, DS_BLOCKED: gl.constexpr = False,
                   Q_REGS: gl.constexpr = 0):
    # WGS: consumer warpgroups, 64 query rows each (2, or 3 for d=64: FA3's 192-row tiles).
    # head_group: the tiles (the tile counter's ids, or the grid's CTAs) in grouped heaviest-
    # first order (``sm90_common.grouped_order``, ``LPT``); 1: one head after another
    # PAGED: batched queries over a paged KV cache (``attn_fwd_sm90_paged``): CU_K holds the key
    # counts, BT the page table [batch, bt_width] (row stride stride_btb), k_desc / v_desc view
    # the cache as [pages * PAGE, heads * d] rows with boxes of min(PAGE, BLOCK_N) rows.
    # PERSISTENT (batched only): a grid of at most one CTA per SM, each walking query tiles
    # (``_consumer_persistent``); n_bh = batch * heads; DYNAMIC: tiles past the first G drawn
    # from COUNTER, which the last CTA zeroes when COUNTER_RESET (``_tile_counter``).
    # Otherwise one CTA per (query tile, batch * head) on a 2D grid. O_TMA (persistent): O by TMA from the tile's last V stage
    # (``_store_tile``).
    # fp8 (e4m3 q, k, v: FlashAttention-3's fp8 forward; batched, one CTA per tile or
    # persistent, or varlen): V's descriptor views it keys innermost ([batch * heads_k * d_v,
    # seqlen_k] rows, varlen [heads_k * d_v, total_k], boxes [d_v, BLOCK_N]: the K-major
    # operand fp8 wgmma takes; ``_v_rows``), O is bf16 (stored from registers), and QD / KD /
    # VD are fp32 descales per (batch, head) (strides; Q's head is off_h // qd_group), folded
    # into the score scale (Q's and K's) and O (V's), read per tile (``_fp8_tile_descales``).
    # DS_BLOCKED: the descales by blocks of FP8_BLOCK rows too (stride_qdk, ...; a per-head one
    # has stride 0): Q's one a tile (its 128 rows), K's and V's read per key block
    # (``_steady_blocks``). Q_REGS: Q's first columns in registers as Q·Kᵀ's operand (``_qk``)
    FP8: gl.constexpr = q_desc.dtype.is_fp8()
    gl.static_assert(not DS_BLOCKED or (WGS * HALF_M == FP8_BLOCK and FP8_BLOCK % BLOCK_N == 0),
                     "block descales need 128-row query tiles and key tiles dividing 128")
    gl.static_assert(not (FP8 and (PAGED or (PERSISTENT and (O_TMA or Q_BUFS != 1)))),
                     "the fp8 forward: batched or varlen, O from registers, one Q buffer")
    HEAD_D: gl.constexpr = box_cols(q_desc.block_type.shape)
    # V's and O's tile width
    HEAD_DV: gl.constexpr = v_desc.block_type.shape[0] if FP8 else box_cols(v_desc.block_type.shape)
    gl.static_assert(not (PERSISTENT and (IS_VARLEN or PAGED)),
                     "the persistent form covers batched (not varlen or paged) problems")
    gl.static_assert(WGS == 2 or WGS == 3, "two or three consumer warpgroups")
    gl.static_assert(Q_REGS == 0 or QK_COLS == 0, "Q in registers (Q_REGS): Q·Kᵀ over all of d")
    gl.static_assert(Q_BUFS == 1 or (Q_BUFS == 2 and PERSISTENT),
                     "two Q buffers in the persistent form only")
    if not PERSISTENT:
        (off_b, off_h, off_hk, q_start, seqlen_q, k_start, seqlen_k, lse_start, start_m, lo,
         n_tiles) = query_tile(CU_Q, CU_K, n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed,
                               window_left, window_right, WGS * HALF_M, BLOCK_N, IS_VARLEN,
                               HAS_LEFT, HAS_RIGHT, PAGED, head_group)
        if start_m >= seqlen_q:
            return

    # Q: one 64-row piece a consumer warpgroup, in Q_BUFS buffers (buffer b: pieces b * WGS..)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_BUFS * WGS, HALF_M, HEAD_D],
                                       tile_layout(q_desc.layout))
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D],
                                       tile_layout(k_desc.layout))
    if FP8:  # (keys innermost)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, HEAD_DV, BLOCK_N],
                                           tile_layout(v_desc.layout))
    else:
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DV],
                                           tile_layout(v_desc.layout))
    q_bar = barriers(Q_BUFS, 1)
    q_empty = barriers(Q_BUFS, WGS)  # persistent: one arrive per consumer warpgroup
    v_fixed = barriers(1, 1)
    turn = barriers(WGS, 1)  # pingpong: one per consumer warpgroup
    k_full = barriers(STAGES, 1)
    v_full = barriers(STAGES, 1)
    k_empty = barriers(STAGES, WGS)  # one arrive per consumer warpgroup
    v_empty = barriers(STAGES, WGS)
    fence_async_shared()

    if PERSISTENT:
        # (dynamic scheduling) the tile ids the producer passes on: a 2-slot ring
        tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1],
                                              gl.SwizzledSharedLayout(1, 1, 1, [0]))
        tile_full = barriers(2, 1)
        tile_empty = barriers(2, WGS)  # one arrive per consumer warpgroup
        o_bar = barriers(1, WGS)  # (O_TMA) every warpgroup's last P·V of a tile has retired
        if WGS == 3:
            gl.warp_specialize([
                (_consumer_persistent, (o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar,
                                        q_empty, k_full, v_full, k_empty, v_empty,
                                        v_fixed.index(0), turn, CU_Q, CU_K, stride_om, stride_oh,
                                        stride_lb, stride_lh, n_heads, kv_group, seqlen_q_fixed,
                                        seqlen_k_fixed, n_bh, window_left, window_right,
                                        qk_scale_log2, softcap_scale,
                                        tile_smem, tile_full, tile_empty, o_bar.index(0),
                                        0, STAGES, HAS_LEFT, HAS_RIGHT, PINGPONG, DYNAMIC,
                                        EXP_EARLY, O_COLS, QK_COLS, O_TMA, Q_BUFS, QD, KD,
                                        VD, stride_qdb, stride_qdh, stride_qdk, stride_kdb,
                                        stride_kdh, stride_kdk, stride_vdb, stride_vdh,
                                        stride_vdk, qd_group, DS_BLOCKED, Q_REGS)),
                (_consumer_persistent, (o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar,
                                        q_empty, k_full, v_full, k_empty, v_empty,
                                        v_fixed.index(0), turn, CU_Q, CU_K, stride_om, stride_oh,
                                        stride_lb, stride_lh, n_heads, kv_group, seqlen_q_fixed,
                                        seqlen_k_fixed, n_bh, window_left, window_right,
                                        qk_scale_log2, softcap_scale,
                                        tile_smem, tile_full, tile_empty, o_bar.index(0),
                                        1, STAGES, HAS_LEFT, HAS_RIGHT, PINGPONG, DYNAMIC,
                                        EXP_EARLY, O_COLS, QK_COLS, O_TMA, Q_BUFS, QD, KD,
                                        VD, stride_qdb, stride_qdh, stride_qdk, stride_kdb,
                                        stride_kdh, stride_kdk, stride_vdb, stride_vdh,
                                        stride_vdk, qd_group, DS_BLOCKED, Q_REGS)),
                (_consumer_persistent, (o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar,
                                        q_empty, k_full, v_full, k_empty, v_empty,
                                        v_fixed.index(0), turn, CU_Q, CU_K, stride_om, stride_oh,
                                        stride_lb, stride_lh, n_heads, kv_group, seqlen_q_fixed,
                                        seqlen_k_fixed, n_bh, window_left, window_right,
                                        qk_scale_log2, softcap_scale,
                                        tile_smem, tile_full, tile_empty, o_bar.index(0),
                                        2, STAGES, HAS_LEFT, HAS_RIGHT, PINGPONG, DYNAMIC,
                                        EXP_EARLY, O_COLS, QK_COLS, O_TMA, Q_BUFS, QD, KD,
                                        VD, stride_qdb, stride_qdh, stride_qdk, stride_kdb,
                                        stride_kdh, stride_kdk, stride_vdb, stride_vdh,
                                        stride_vdk, qd_group, DS_BLOCKED, Q_REGS)),
                (_producer_persistent, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar,
                                        q_empty, k_full, v_full, k_empty, v_empty,
                                        v_fixed.index(0), BT, CU_Q, CU_K, n_heads, kv_group,
                                        seqlen_q_fixed, seqlen_k_fixed, n_bh, window_left, window_right,
                                        COUNTER, tile_smem, tile_full, tile_empty,
                                        STAGES, HAS_LEFT, HAS_RIGHT, DYNAMIC, head_group,
                                        Q_BUFS)),
            ], [4, 4, 1], [CONSUMER_REGS_, CONSUMER_REGS_, PRODUCER_REGS_])
        else:
            gl.warp_specialize([
                (_consumer_persistent, (o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar,
                                        q_empty, k_full, v_full, k_empty, v_empty,
                                        v_fixed.index(0), turn, CU_Q, CU_K, stride_om, stride_oh,
                                        stride_lb, stride_lh, n_heads, kv_group, seqlen_q_fixed,
                                        seqlen_k_fixed, n_bh, window_left, window_right,
                                        qk_scale_log2, softcap_scale,
                                        tile_smem, tile_full, tile_empty, o_bar.index(0),
                                        0, STAGES, HAS_LEFT, HAS_RIGHT, PINGPONG, DYNAMIC,
                                        EXP_EARLY, O_COLS, QK_COLS, O_TMA, Q_BUFS, QD, KD,
                                        VD, stride_qdb, stride_qdh, stride_qdk, stride_kdb,
                                        stride_kdh, stride_kdk, stride_vdb, stride_vdh,
                                        stride_vdk, qd_group, DS_BLOCKED, Q_REGS)),
                (_consumer_persistent, (o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar,
                                        q_empty, k_full, v_full, k_empty, v_empty,
                                        v_fixed.index(0), turn, CU_Q, CU_K, stride_om, stride_oh,
                                        stride_lb, stride_lh, n_heads, kv_group, seqlen_q_fixed,
                                        seqlen_k_fixed, n_bh, window_left, window_right,
                                        qk_scale_log2, softcap_scale,
                                        tile_smem, tile_full, tile_empty, o_bar.index(0),
                                        1, STAGES, HAS_LEFT, HAS_RIGHT, PINGPONG, DYNAMIC,
                                        EXP_EARLY, O_COLS, QK_COLS, O_TMA, Q_BUFS, QD, KD,
                                        VD, stride_qdb, stride_qdh, stride_qdk, stride_kdb,
                                        stride_kdh, stride_kdk, stride_vdb, stride_vdh,
                                        stride_vdk, qd_group, DS_BLOCKED, Q_REGS)),
                (_producer_persistent, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar,
                                        q_empty, k_full, v_full, k_empty, v_empty,
                                        v_fixed.index(0), BT, CU_Q, CU_K, n_heads, kv_group,
                                        seqlen_q_fixed, seqlen_k_fixed, n_bh, window_left, window_right,
                                        COUNTER, tile_smem, tile_full, tile_empty,
                                        STAGES, HAS_LEFT, HAS_RIGHT, DYNAMIC, head_group,
                                        Q_BUFS)),
            ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])
        invalidate(tile_full, 2)
        invalidate(tile_empty, 2)
        invalidate(o_bar, 1)
        if DYNAMIC and COUNTER_RESET:
            _release_counter(COUNTER)
    else:
        q_row = q_start + start_m
        o_base_off = q_start.to(gl.int64) * stride_om + off_h.to(gl.int64) * stride_oh
        lse_off = off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + lse_start
        o_scale = 1.0
        vt_row = 0
        vt_key0 = 0
        # (fp8 block descales) K's and V's of this (batch, head), by key block (0 otherwise:
        # warp_specialize takes no None)
        KDB = 0
        VDB = 0
        if FP8:
            d_qk, o_scale, KDB, VDB = _fp8_tile_descales(
                QD, KD, VD, stride_qdb, stride_qdh, stride_qdk, stride_kdb, stride_kdh,
                stride_vdb, stride_vdh, qd_group, off_b, off_h, off_hk, start_m, DS_BLOCKED)
            if softcap_scale is None:
                qk_scale_log2 = _live_descale(qk_scale_log2 * d_qk)
            else:
                softcap_scale = _live_descale(softcap_scale * d_qk)
            vt_row = _v_rows(off_b, off_hk, n_heads // kv_group, HEAD_DV, IS_VARLEN)
            if IS_VARLEN:  # (the sequence's keys: columns from its first)
                vt_key0 = k_start
        if WGS == 3:
            gl.warp_specialize([
                (_consumer, (o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar.index(0),
                             q_empty.index(0), k_full, v_full, k_empty, v_empty, v_fixed.index(0),
                             turn, q_row, off_h * HEAD_DV, o_base_off, stride_om, lse_off, start_m,
                             seqlen_q, seqlen_k, lo, n_tiles, window_left, window_right,
                             qk_scale_log2,
                             softcap_scale, 0, STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN or PAGED,
                             PINGPONG, EXP_EARLY, O_COLS, QK_COLS, o_scale, KDB, VDB,
                             stride_kdk, stride_vdk, DS_BLOCKED, Q_REGS)),
                (_consumer, (o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar.index(0),
                             q_empty.index(0), k_full, v_full, k_empty, v_empty, v_fixed.index(0),
                             turn, q_row, off_h * HEAD_DV, o_base_off, stride_om, lse_off, start_m,
                             seqlen_q, seqlen_k, lo, n_tiles, window_left, window_right,
                             qk_scale_log2,
                             softcap_scale, 1, STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN or PAGED,
                             PINGPONG, EXP_EARLY, O_COLS, QK_COLS, o_scale, KDB, VDB,
                             stride_kdk, stride_vdk, DS_BLOCKED, Q_REGS)),
                (_consumer, (o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar.index(0),
                             q_empty.index(0), k_full, v_full, k_empty, v_empty, v_fixed.index(0),
                             turn, q_row, off_h * HEAD_DV, o_base_off, stride_om, lse_off, start_m,
                             seqlen_q, seqlen_k, lo, n_tiles, window_left, window_right,
                             qk_scale_log2,
                             softcap_scale, 2, STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN or PAGED,
                             PINGPONG, EXP_EARLY, O_COLS, QK_COLS, o_scale, KDB, VDB,
                             stride_kdk, stride_vdk, DS_BLOCKED, Q_REGS)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar.index(0),
                             q_empty.index(0), k_full, v_full, k_empty, v_empty, v_fixed.index(0),
                             BT, off_b.to(gl.int64) * stride_btb, bt_width, q_row, off_h * HEAD_D,
                             k_start + lo, off_hk * HEAD_D, n_tiles, seqlen_k - lo, STAGES,
                             IS_VARLEN, PAGED, PAGE, vt_row, vt_key0 + lo)),
            ], [4, 4, 1], [CONSUMER_REGS_, CONSUMER_REGS_, PRODUCER_REGS_])
        else:
            gl.warp_specialize([
                (_consumer, (o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar.index(0),
                             q_empty.index(0), k_full, v_full, k_empty, v_empty, v_fixed.index(0),
                             turn, q_row, off_h * HEAD_DV, o_base_off, stride_om, lse_off, start_m,
                             seqlen_q, seqlen_k, lo, n_tiles, window_left, window_right,
                             qk_scale_log2,
                             softcap_scale, 0, STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN or PAGED,
                             PINGPONG, EXP_EARLY, O_COLS, QK_COLS, o_scale, KDB, VDB,
                             stride_kdk, stride_vdk, DS_BLOCKED, Q_REGS)),
                (_consumer, (o_desc, O, LSE, q_smem, k_smem, v_smem, q_bar.index(0),
                             q_empty.index(0), k_full, v_full, k_empty, v_empty, v_fixed.index(0),
                             turn, q_row, off_h * HEAD_DV, o_base_off, stride_om, lse_off, start_m,
                             seqlen_q, seqlen_k, lo, n_tiles, window_left, window_right,
                             qk_scale_log2,
                             softcap_scale, 1, STAGES, HAS_LEFT, HAS_RIGHT, IS_VARLEN or PAGED,
                             PINGPONG, EXP_EARLY, O_COLS, QK_COLS, o_scale, KDB, VDB,
                             stride_kdk, stride_vdk, DS_BLOCKED, Q_REGS)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar.index(0),
                             q_empty.index(0), k_full, v_full, k_empty, v_empty, v_fixed.index(0),
                             BT, off_b.to(gl.int64) * stride_btb, bt_width, q_row, off_h * HEAD_D,
                             k_start + lo, off_hk * HEAD_D, n_tiles, seqlen_k - lo, STAGES,
                             IS_VARLEN, PAGED, PAGE, vt_row, vt_key0 + lo)),
            ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])

    invalidate(q_bar, Q_BUFS)
    invalidate(q_empty, Q_BUFS)
    invalidate(v_fixed, 1)
    invalidate(turn, WGS)
    invalidate(k_full, STAGES)
    invalidate(v_full, STAGES)
    invalidate(k_empty, STAGES)
    invalidate(v_empty, STAGES)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int,
                       head_dim_v: int, softcap: float, has_alibi: bool, dropout_p: float,
                       varlen: bool) -> str | None:
    """Why this call is outside what the sm90 forward covers (None when inside)."""
    # (zero-padded pairs are copied, so any layout does)
    padded = (head_dim, head_dim_v) in PADDED_HEAD_DIMS
    if not padded and (head_dim not in SUPPORTED_HEAD_DIMS or head_dim_v != head_dim):
        return (f"head dims (d={head_dim}, d_v={head_dim_v}) are not covered yet: the sm90 kernels "
                f"take d = d_v in {SUPPORTED_HEAD_DIMS}, or (d, d_v) in "
                f"{tuple(PADDED_HEAD_DIMS)} zero-padded")
    if has_alibi or dropout_p > 0:
        return "ALiBi and dropout are not covered by the sm90 kernels yet"
    if q.dtype not in OPERAND_DTYPES:
        return f"dtype {q.dtype} is not fp16/bf16"
    for name, t in (("q", q), ("k", k), ("v", v)):
        problem = None if padded else tma_view_problem(name, t, varlen)
        if problem is not None:
            return problem
    return None


def fp8_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descales: tuple,
                           softcap: float, has_alibi: bool, dropout_p: float,
                           varlen: bool) -> str | None:
    """Why an fp8 call (e4m3 q, k, v; descales as ``flash_attn_func`` takes them) is outside
    what the sm90 forward covers (None when inside): batched, d = d_v in SUPPORTED_HEAD_DIMS,
    per-head descales (None, [batch, heads] or [batch, heads, 1]), or block descales with
    FP8_BLOCK_ON; V in any layout (copied keys innermost where it is not, ``_keys_major``)."""
    if not FP8_ON:
        return ("the sm90 fp8 forward is off (IOATTN_SM90_FP8=0); fp8 calls run on the portable "
                "kernel (backend='triton' or 'auto')")
    d, d_v = q.shape[-1], v.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS or d_v != d:
        return (f"head dims (d={d}, d_v={d_v}): the sm90 fp8 forward takes d = d_v in "
                f"{SUPPORTED_HEAD_DIMS}")
    if varlen and not FP8_VARLEN_ON:
        return ("varlen fp8 calls run on the portable kernel unless IOATTN_SM90_FP8_VARLEN=1 "
                "(opt-in)")
    if has_alibi or dropout_p > 0:
        return "ALiBi and dropout are not covered by the sm90 kernels yet"
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales):
        if t is not None and t.dim() == 3 and t.shape[2] > 1 and not FP8_BLOCK_ON:
            return (f"{name} is a block descale ({t.shape[2]} blocks of rows): the sm90 fp8 "
                    f"forward takes per-head descales ([batch, heads]), as FlashAttention-3, "
                    f"unless IOATTN_SM90_FP8_BLOCK=1 (opt-in)")
    for name, t in (("q", q), ("k", k)):
        problem = tma_view_problem(name, t, varlen)
        if problem is not None:
            return problem
    return None


def _keys_major(v: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(V, row stride) with V's keys innermost as the fp8 forward's descriptor views it: [batch *
    heads * d, seqlen] rows of 16-byte aligned stride (``ioattn.fp8.keys_contiguous`` gives
    that layout whenever seqlen is a multiple of 16); otherwise a copy laid out so, its rows
    padded to a multiple of 16 keys (the descriptor's extent stays seqlen: TMA zero-fills)."""
    b, s, h, d = v.shape
    st = v.stride()
    if (st[1] == 1 and st[2] == d * st[3] and (b == 1 or st[0] == h * d * st[3])
            and st[3] % 16 == 0 and v.data_ptr() % 16 == 0):
        return v, st[3]
    s_pad = -(-s // 16) * 16
    buf = torch.empty(b, h, d, s_pad, dtype=v.dtype, device=v.device)
    buf[..., :s].copy_(v.permute(0, 2, 3, 1))
    return buf[..., :s].permute(0, 3, 1, 2), s_pad


def _fp8_descale_args(p: AttnParams, n_heads: int) -> dict:
    """The kernel's descale arguments: QD, KD, VD (AttnParams' [batch, heads, blocks] fp32
    views; a per-head one has a block stride of 0) with their batch, head and block strides,
    Q's head group (1: per query head; the GQA group: per KV head), and DS_BLOCKED when K's or
    V's varies by block."""
    ds = (p.q_descale, p.k_descale, p.v_descale)
    # (Q's block descale needs no per-block loop: one a tile, through stride_qdk)
    out = dict(qd_group=n_heads // p.q_descale.shape[1],
               DS_BLOCKED=p.k_descale.stride(2) != 0 or p.v_descale.stride(2) != 0)
    for name, t in zip(("qd", "kd", "vd"), ds):
        out.update({name.upper(): t, f"stride_{name}b": t.stride(0), f"stride_{name}h": t.stride(1),
                    f"stride_{name}k": t.stride(2)})
    return out


def _fp8_form(head_dim: int, varlen: bool = False, persistent: bool | None = None,
              q_regs: bool | None = None) -> dict:
    """The fp8 forward's launch form: one CTA per 128-row tile (two consumer warpgroups), or
    (batched, ``FP8_PERSISTENT`` unless persistent says) persistent CTAs on the dynamic
    scheduler; keys per tile as the 16-bit forward, and ring stages for fp8's half-size tiles
    (Q 2 x 64 x d plus STAGES x (K + V) of BLOCK_N x d bytes: 104 / 176 / 192 KiB at d = 64 /
    128 / 256, 107 / 181 / 197 KB compiled with the barriers; stages not swept); all of Q in
    registers with ``Q_REGS_ON`` unless q_regs says. Pingpong at d = 128 and 256: on / off at
    d = 128 on an H100 +1-6% in the FA grid's 2k / 16k cells, at d = 64 -8% to +2%
    (results/tune/tune_fp8_sm90_pp_a5d54e7_*)."""
    block_n = _block_n(head_dim)
    stages = {64: 6, 128: 5, 256: 5}[head_dim]
    persistent = (FP8_PERSISTENT if persistent is None else persistent) and not varlen
    # (Q_REGS_ON) all of Q in registers: e4m3 Q is half a 16-bit one's registers (d=256: 32 a
    # thread), so every fp8 form compiles with it without spills
    return dict(WGS=2, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS_=CONSUMER_REGS, Q_BUFS=1,
                PINGPONG=head_dim >= 128 if PINGPONG == "auto" else PINGPONG != "0",
                PERSISTENT=persistent, DYNAMIC=persistent, EXP_EARLY=False, O_TMA=0,
                Q_REGS=head_dim if (Q_REGS_ON if q_regs is None else q_regs) else 0)


def fp8_preferred(head_dim: int, max_seqlen_q: int) -> bool:
    """Whether 'auto' takes the sm90 fp8 forward over the portable one for a call it covers: on
    an H100 (results/fp8_sm90_151c32b_*, results/tune/tune_fp8_sm90*_a5d54e7_*; the portable
    kernel with block descales, the sm90 one per-head, the FA grid) d=128 620-828 TFLOP/s
    against 379-658 and d=256 625-954 against 533-760 in every cell (2k, 16k, causal and not);
    d=64 369 / 294 against 410 / 308 at 2k but 478 / 460 against 439 / 405 at 16k: from 8k
    there (4k and 8k not timed)."""
    return head_dim >= 128 or max_seqlen_q >= 8192


def preferred(head_dim: int, masked: bool, max_seqlen_q: int, max_seqlen_k: int,
              varlen: bool = False, softcap: float = 0.0, head_dim_v: int | None = None,
              window: bool = False) -> bool:
    """Whether 'auto' should take this kernel over the portable one: where it measured faster on
    the H200 (benchmarks/NOTES.md, results/sm90_fwd_*quick_*.json): d=128 from s=2k (1.01-1.32x
    the portable kernel), d=256 from 2k (1.32-1.42x); d=64 from 4k with three consumer
    warpgroups (428 / 353 TFLOP/s non-causal / causal at 4k, results/sm90_fwd_wg3_1_*.json,
    against 390 / 339 for the portable kernel in the run of record; at 2k non-causal they tie;
    the dynamic persistent form, the default for batched problems since, ran 435 / 386 there,
    results/tune/sm90_fwd_persdynamic_*.log), else from 8k (1.06x); batched non-causal d=64 from
    2k (now from 512, below), where the persistent form ran 0.95x cuDNN against the portable
    kernel's 0.88x (results/tune/sm90_fwd_persdynamic_c34f85c_*.log and
    results/tune/sm90_fwd_wg3p_a0cfad4_*.log against results/dense_7c5cc50_*.json and
    dense_76fc236_*.json); causal d=64 from 2k too with
    two Q buffers (``Q_BUFS``): 366 / 357 TFLOP/s with two / one (results/fwd_q_bufs{2,1}_
    be5d13b_*.json) against the portable kernel's 332 (results/dense_1248a25_*.json, where auto
    still took it: 0.90x cuDNN; 0.97x with the sm90 form in results/dense_d27c47a_*.json);
    sliding windows follow the causal rule (not timed apart). The gain comes from the
    pipelined key loop, so a shorter query block over as many keys gains too: 512 queries over 4608 keys (chunked prefill, d=128 causal GQA)
    ran at 590 TFLOP/s through the paged form of this kernel against 454 through the portable
    one (results/chunked_sm90_paged_nvidia-h200_2026-11-29.json); that rule is kept to d >= 128,
    where it was measured (batched non-causal d=64 meets the short-cell rule below instead).

    Softcap (tanh.approx, the default): d in {64, 128} from 2k queries, where it ran 1.24-1.96x
    the portable kernel at cap 30 in every FA-grid cell measured (2k and 8k, causal and not,
    results/softcap_approx_b84f621_*.json; the portable kernel pays more for the tanh); d=256
    with softcap was not timed. The zero-padded head dims from 8k queries: (96, 96) ran 1.18x /
    1.04x the portable kernel non-causal / causal at 8k and (192, 192) 1.23x / 1.04x, but
    0.61-0.83x at 2k, where the padded copies weigh more (results/padded_b84f621_*.json);
    (192, 128) was not timed and stays portable. Read in place (PAD_MODE "tma", the default
    since session 15; results/pad_tma_ae73752_*.json against pad_copy_ae73752_*.json, hidden
    1536, 1k-8k): (192, 192) and (192, 128) from 1k queries (448 / 331 and 376 / 283 TFLOP/s
    non-causal / causal at 1k against the portable 319 / 233 and 304 / 222), (96, 96) from 1k
    too (415 / 284 against 297 / 231, results/fwd96_short_3b476a9_*.json; that run's first
    causal 1k / 2k cells, 214 / 197, did not repeat). Shorter ones were not timed.

    The FA grid's short cells (batched, queries = keys, bf16; the sm90 backend forced beside
    auto's portable kernel and cuDNN in one run, results/short_4528809_nvidia-h200_2026-12-07.json),
    TFLOP/s sm90 / portable: d=256 512 non-causal 453 / 340, causal 300 / 221, 1k 464 / 413 and
    425 / 298; d=128 1k 542 / 393 and 417 / 304, but 512 278 / 312 and 148 / 220; d=64
    non-causal 512 334 / 308, 1k 381 / 365, causal 155 / 216 and 267 / 286. The d=128 512
    cells were the eager call's host time (~125 us a call with the kept launch on, 145-181 off,
    session 36): with the launch kept by the op's signature and descriptor encodings kept by
    address, an eager call costs ~50-70 us of host time on the H100 machine and runs within
    5-8 us of its graph replay (results/tune/host_overhead_c0cc029_*,
    host_graph_counters{0,1}_c0cc029_*); there (H100, the tile counter then a new one a call,
    results/short_auto_c0cc029_nvidia-h100_*.json) sm90 / portable / cuDNN ran 473 / 297 / 487
    non-causal and 284 / 215 / 316 causal. So batched calls take it from 512 queries and keys at
    d=256 and d=128 (its persistent form, the one timed; d=128 at 512 on H100 evidence, the H200
    run is pending), and from 512 at d=64 without a mask. Only these were timed: 16k tokens a
    call (32 /
    16 sequences of 16 heads at d=128), queries = keys, no GQA, bf16; the d=64 margins (1.04 /
    1.08) are within a run's spread. Varlen (not timed there; its max_seqlen only bounds the
    sequences) and sliding windows (``window``: a window of a few key blocks is the 512 cell's
    short loop whatever the length) keep the rules above."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if (head_dim, head_dim_v) in PADDED_HEAD_DIMS:
        if softcap > 0:
            return False
        if sm90_common.PAD_MODE != "tma":  # the zero-padded copies
            return head_dim_v == head_dim and max_seqlen_q >= 8192
        return max_seqlen_q >= 1024
    if head_dim not in SUPPORTED_HEAD_DIMS or head_dim_v != head_dim:
        return False
    if softcap > 0:
        return head_dim in (64, 128) and max_seqlen_q >= 2048
    if head_dim == 64:
        if _persistent(64, varlen) and not masked:  # batched: the persistent form
            return min(max_seqlen_q, max_seqlen_k) >= 512 or max_seqlen_q >= 2048
        if _persistent(64, varlen) and _two_q(64, masked, max_seqlen_k):
            return max_seqlen_q >= 2048  # (masked: two Q buffers)
        return max_seqlen_q >= (4096 if WG3 or _persistent(64, varlen) else 8192)
    if not (varlen or window) and (head_dim == 256 or _persistent(head_dim, varlen)) \
            and min(max_seqlen_q, max_seqlen_k) >= 512:
        return True  # batched, from 512 at d=128 and d=256 (the FA grid's short cells)
    return max_seqlen_q >= 2048 or (max_seqlen_q >= 512 and max_seqlen_k >= 2048)


def _schedule(head_dim: int, varlen: bool) -> str | None:
    """The forward's persistent schedule ("dynamic", "static") or None for one CTA per tile:
    batched problems only (varlen/paged tiles keep one CTA each: their last-tile zeroing is
    signalled once per CTA); ``PERSISTENT_MODE`` says which."""
    if varlen or PERSISTENT_MODE in ("0", "off", "false"):
        return None
    if PERSISTENT_MODE == "auto":
        return "dynamic" if head_dim in (64, 128) else None
    return "dynamic" if PERSISTENT_MODE == "dynamic" else "static"


def _persistent(head_dim: int, varlen: bool) -> bool:
    return _schedule(head_dim, varlen) is not None


def mask_kind(window_left: int, window_right: int) -> str:
    """The launch rules' mask: "none", "causal" (a right window without a left one, as measured
    for causal masks) or "window"."""
    if window_left < 0 and window_right < 0:
        return "none"
    return "causal" if window_left < 0 else "window"


def launch_form(head_dim: int, varlen: bool, mask: str, max_seqlen_q: int,
                max_seqlen_k: int | None = None, q_regs: bool = True) -> dict:
    """The forward's constexprs that depend on the problem's shape (``attn_fwd_sm90``, and the
    compile checks of ``inspect``): consumer warpgroups, keys per tile, ring stages, consumer
    registers, Q buffers (``Q_BUFS``: by max_seqlen_k, max_seqlen_q if None), pingpong,
    persistence and its scheduler, the exponentials' place, O's store by TMA (``_o_tma`` adds
    the launch's own conditions), Q in registers (``Q_REGS_ON``, ``q_regs_form``; q_regs=False
    leaves it out: padded head dims, the compile checks' default forms; all of Q in registers
    takes one Q buffer, whatever ``Q_BUFS`` says). mask: ``mask_kind``'s."""
    if mask not in ("none", "causal", "window"):
        raise ValueError(f"mask={mask!r}: expected 'none', 'causal' or 'window'")
    wide = _wide(head_dim, varlen, mask, max_seqlen_q)
    wgs = _wgs(head_dim, varlen, wide=wide)
    block_n, stages, regs = _tile(head_dim, wgs, wide)
    schedule = _schedule(head_dim, varlen)
    persistent = schedule is not None
    # O (``_store_tile``): 0 from registers; by TMA from the tile's last V stage (1: released
    # after the store, 2: a block into the next tile, ``O_DEFER``), where the stage holds every
    # consumer warpgroup's 64 rows
    o_tma = (2 if O_DEFER else 1) if O_TMA and persistent and block_n >= 64 * wgs else 0
    form = dict(WGS=wgs, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS_=regs, Q_BUFS=1,
                PINGPONG=_pingpong(head_dim, wgs), PERSISTENT=persistent,
                DYNAMIC=schedule == "dynamic", EXP_EARLY=_exp_early(head_dim, wide, mask),
                O_TMA=o_tma)
    if Q_REGS_ON and q_regs and not varlen:
        form = q_regs_form(form, head_dim, mask)
    if max_seqlen_k is None:
        max_seqlen_k = max_seqlen_q
    # (all of Q in registers frees its one buffer as soon as it is loaded: no second one)
    two = _two_q(head_dim, mask != "none", max_seqlen_k) and form.get("Q_REGS") != head_dim
    return two_q_buffers(form, head_dim) if two else form


def q_regs_form(form: dict, head_dim: int, mask: str) -> dict:
    """A batched launch form with Q's first columns in registers (``Q_REGS_ON``'s rule): d=128
    all of them, with the exponentials early without a mask (and one Q buffer, freed once
    loaded: ``launch_form``), persistent forms only; d=256 64 of them; others (d=64's three
    warpgroups, windows) as they are. (Varlen forms are left out by the caller: the d=128
    one-CTA-a-tile form spilled ~1 KB in its key loop with Q in registers.)"""
    if head_dim not in (128, 256) or form["WGS"] != 2 or mask not in ("none", "causal"):
        return form
    if head_dim == 128 and not form["PERSISTENT"]:  # (its one-CTA-a-tile form spills with it)
        return form
    early = form["EXP_EARLY"] or (head_dim == 128 and mask == "none")
    return dict(form, Q_REGS=128 if head_dim == 128 else 64, EXP_EARLY=early)


def _two_q(head_dim: int, masked: bool, max_seqlen_k: int) -> bool:
    """Whether the persistent forward takes Q in two buffers (``Q_BUFS``) for this problem:
    "auto" up to Q_BUFS_MAX_SEQLEN_K keys, but not at d=64 without a mask (one buffer ran 4-10%
    faster there, ``Q_BUFS``' comment)."""
    if Q_BUFS != "auto":
        return Q_BUFS == "2"
    return max_seqlen_k <= Q_BUFS_MAX_SEQLEN_K and (masked or head_dim != 64)


def two_q_buffers(form: dict, head_dim: int) -> dict:
    """A launch form (``launch_form``'s, or a compile job's constexprs) with Q in two buffers
    (``Q_BUFS``): persistent forms at d = 64 / 128 only (others as they are); two ring stages at
    d = 128 (shared memory); with ``O_TMA``, O staged in the warpgroup's piece of the tile's Q
    buffer (3: released as at 2), whatever the tile."""
    if not form["PERSISTENT"] or head_dim not in (64, 128):
        return form
    return dict(form, Q_BUFS=2, STAGES=2 if head_dim == 128 else form["STAGES"],
                O_TMA=3 if O_TMA else 0)


def _o_tma(form: dict, d_pad: int | None, max_seqlen_k: int) -> int:
    """Whether the persistent forward stores O by TMA from the last V stage (0: no; 2: with the
    stage's release deferred, ``O_DEFER``; 3: from the tile's Q buffer): the form's rule
    (``launch_form``, ``two_q_buffers``), O a [rows, heads * d_v] matrix (not a head dim
    read in place through [rows, heads, d] views), and more than one key: Triton specializes an
    integer argument of 1 into a constant, and with seqlen_k = 1 folded in this form fails in
    LLVM lowering (an assertion in SmallVector, Triton 3.6; one key is one key tile, nothing for
    the TMA store to gain)."""
    return form["O_TMA"] if d_pad is None and max_seqlen_k != 1 else 0


def attn_fwd_sm90(p: AttnParams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, bind_key=None) -> None:
    """Launch the sm90 forward into ``out`` / ``lse`` (layouts as ``triton_fwd.attn_fwd``).
    Head dims (d, d_v) in PADDED_HEAD_DIMS are read in place through [rows, heads, d] views
    whose boxes the TMA unit zero-fills past d (``IOATTN_SM90_PAD=tma``; the op copies them into
    padded tensors otherwise), and O's columns past d_v are not written. bind_key (batched
    calls, from the op): the op's memo signature of this call with q / k / v's 16-byte
    alignment, which fixes every argument but the addresses (out and LSE are new contiguous
    tensors shaped from q and v; the unused pointers are LSE's): with this module's switches
    (``_switches``) and the device's SM count it keys the kept launch, so a repeat skips the
    launch rules and this module's own key."""
    if bind_key is not None and BIND:  # (sm_count: the grid; tests patch it)
        bind_key = (bind_key, _switches(), sm_count(q.device))
        bound = _BOUND.get(bind_key)
        if bound is not None:  # (a tenth slot: the dynamic scheduler's counter)
            lp = lse.data_ptr()
            if bound(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), out.data_ptr(),
                     lp, lp, lp, lp,
                     *((_tile_counter(q.device).data_ptr(),) if len(bound.slots) > 9 else ())):
                return
    d, d_v = q.shape[-1], v.shape[-1]
    d_pad = PADDED_HEAD_DIMS.get((d, d_v))
    n_heads, n_heads_k = q.shape[-2], k.shape[-2]
    if p.fp8:  # (``fp8_unsupported_reason`` has accepted the call)
        _attn_fwd_sm90_fp8(p, q, k, v, out, lse)
        return
    # (head dims read padded keep Q in shared memory: Q_REGS has no narrow-column form)
    form = launch_form(d_pad or d, p.is_varlen, mask_kind(p.window_left, p.window_right),
                       p.max_seqlen_q, p.max_seqlen_k, q_regs=d_pad is None)
    grid = (-(-p.max_seqlen_q // (form["WGS"] * HALF_M.value)), p.batch * n_heads)
    if grid[0] * grid[1] == 0:
        return
    grid, group, counter = _schedule_launch(form, grid, q.device)
    # (IOATTN_SM90_PAD_NARROW) QKᵀ over d's own columns, V and O in tiles of their own width
    qk_cols, dv_pad = (d, narrow_dv(d_v)) if d_pad and sm90_common.PAD_NARROW else (0, d_pad)
    o_tma = _o_tma(form, d_pad, p.max_seqlen_k)
    dummy = lse  # unused pointer arguments (batched layout)
    cu_q = p.cu_seqlens_q if p.is_varlen else dummy
    cu_k = p.cu_seqlens_k if p.is_varlen else dummy
    key = bind_key if BIND else None
    if BIND and key is None:  # (``BIND``) a repeat of this call's form: one C call at this
        # call's addresses
        key = (q.device, grid, group, qk_cols, dv_pad, o_tma, tuple(form.items()), q.dtype,
               q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.dtype,
               out.shape, out.stride(), lse.shape, lse.stride(),
               tuple(t.data_ptr() % 16 == 0 for t in (q, k, v, out, lse, cu_q, cu_k)),
               p.is_varlen, p.max_seqlen_q, p.max_seqlen_k, p.batch, p.softmax_scale,
               p.softcap, p.window_left, p.window_right, PRODUCER_REGS, STREAM_COUNTERS)
        if key in _BOUND and repeat(
                _BOUND, key, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                out.data_ptr(), lse.data_ptr(), cu_q.data_ptr(), cu_k.data_ptr(),
                dummy.data_ptr(), *((counter.data_ptr(),) if form["DYNAMIC"] else ())):
            return
    qk_scale_log2, softcap_scale = score_scales(p.softmax_scale, p.softcap)
    args = (rows_descriptor(q, p.is_varlen, HALF_M.value, pad_to=d_pad),
            rows_descriptor(k, p.is_varlen, form["BLOCK_N"], pad_to=d_pad),
            rows_descriptor(v, p.is_varlen, form["BLOCK_N"], pad_to=dv_pad),
            rows_descriptor(out, p.is_varlen, HALF_M.value, pad_to=dv_pad), out, lse,
            cu_q, cu_k, dummy,
            out.stride(-3), out.stride(-2), *p.lse_strides(lse), 0, 0,
            n_heads, n_heads // n_heads_k, p.max_seqlen_q, p.max_seqlen_k, p.batch * n_heads,
            qk_scale_log2, p.window_left, p.window_right)
    kwargs = dict(softcap_scale=softcap_scale,
                  IS_VARLEN=p.is_varlen, HAS_LEFT=p.window_left >= 0,
                  HAS_RIGHT=p.window_right >= 0, PRODUCER_REGS_=PRODUCER_REGS, PAGED=False,
                  PAGE=1, **dict(form, O_TMA=o_tma), COUNTER=counter,
                  O_COLS=d_v if dv_pad and dv_pad != d_v else 0, head_group=group,
                  QK_COLS=qk_cols, COUNTER_RESET=form["DYNAMIC"] and STREAM_COUNTERS,
                  num_warps=4)
    lch = launcher(_attn_fwd_sm90)
    if key is None:
        lch[grid](*args, **kwargs)
        return
    # (slots: the four descriptors' bases, O, LSE, CU_Q, CU_K, BT; the counter if dynamic)
    slots = tuple(range(9)) + ((lch.names.index("COUNTER"),) if form["DYNAMIC"] else ())
    lch.bind_kept(_BOUND, key, grid, args, kwargs, slots)


def _schedule_launch(form: dict, grid: tuple, device: torch.device) -> tuple:
    """(grid, head_group, counter) of a launch form over grid (query tiles, batch * heads):
    persistent forms one CTA an SM (a CTA takes most of the shared memory), the dynamic
    scheduler's tile counter (``_tile_counter``; None otherwise); head_group the grouped
    heaviest-first order's (``LPT``; 1: a static persistent form keeps its snake order)."""
    group = 1
    if form["PERSISTENT"]:
        n_m, n_bh = grid
        grid = (min(n_m * n_bh, sm_count(device)),)
        if LPT and form["DYNAMIC"]:
            group = head_group_size(n_bh, n_m, grid[0])
    elif LPT:
        group = head_group_size(grid[1], grid[0], sm_count(device))
    return grid, group, _tile_counter(device) if form["DYNAMIC"] else None


def _attn_fwd_sm90_fp8(p: AttnParams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor) -> None:
    """``attn_fwd_sm90`` for fp8 q, k, v (batched, or varlen with FP8_VARLEN_ON; per-head
    descales, or block ones with FP8_BLOCK_ON): one CTA per tile, or persistent CTAs
    (``_fp8_form``: batched, FP8_PERSISTENT); V read keys innermost (``_keys_major``; varlen V
    as one batch of total_k keys), O in bf16."""
    d = q.shape[-1]
    n_heads, n_heads_k = q.shape[-2], k.shape[-2]
    varlen = p.is_varlen
    form = _fp8_form(d, varlen)
    grid = (-(-p.max_seqlen_q // (form["WGS"] * HALF_M.value)), p.batch * n_heads)
    if grid[0] * grid[1] == 0:
        return
    grid, group, counter = _schedule_launch(form, grid, q.device)
    vt, vt_stride = _keys_major(v[None] if varlen else v)
    b, s_k = vt.shape[0], vt.shape[1]
    v_desc = Desc(vt, (b * n_heads_k * d, s_k), (vt_stride, 1), (d, form["BLOCK_N"]),
                  sm90_common.shared_layout(d, form["BLOCK_N"], v.dtype))
    qk_scale_log2, softcap_scale = score_scales(p.softmax_scale, p.softcap)
    dummy = lse  # (unused pointers: batched calls' cu_seqlens, the page table)
    launcher(_attn_fwd_sm90)[grid](
        rows_descriptor(q, varlen, HALF_M.value), rows_descriptor(k, varlen, form["BLOCK_N"]),
        v_desc, rows_descriptor(out, varlen, HALF_M.value), out, lse,
        p.cu_seqlens_q if varlen else dummy, p.cu_seqlens_k if varlen else dummy, dummy,
        out.stride(-3), out.stride(-2), *p.lse_strides(lse), 0, 0,
        n_heads, n_heads // n_heads_k, p.max_seqlen_q, p.max_seqlen_k, p.batch * n_heads,
        qk_scale_log2, p.window_left, p.window_right, **_fp8_descale_args(p, n_heads),
        softcap_scale=softcap_scale, IS_VARLEN=varlen, HAS_LEFT=p.window_left >= 0,
        HAS_RIGHT=p.window_right >= 0, PRODUCER_REGS_=PRODUCER_REGS, PAGED=False, PAGE=1,
        **form, COUNTER=counter, O_COLS=0, head_group=group, QK_COLS=0,
        COUNTER_RESET=form["DYNAMIC"] and STREAM_COUNTERS, num_warps=4)


def _switches() -> tuple:
    """The module settings the launch rules read (tests change some between calls of one
    shape), for kept launches keyed by the op's signature (with the SM count, which the grid
    reads too)."""
    return (PINGPONG, PERSISTENT_MODE, LPT, O_TMA, O_DEFER, Q_BUFS, Q_BUFS_MAX_SEQLEN_K, WG3,
            WG3_PERSISTENT, WG3_BLOCK_N, EXP_EARLY_MODE, PRODUCER_REGS, CONSUMER_REGS,
            STREAM_COUNTERS, sm90_common.PAD_NARROW, sm90_common.SOFTCAP_APPROX.value, Q_REGS_ON)


_BOUND: dict = {}  # ``attn_fwd_sm90``'s kept launches (``BIND``), by the call's form
_COUNTERS: dict = {}  # (device index, stream) -> the dynamic scheduler's counter (``_tile_counter``)


def _tile_counter(device: torch.device) -> torch.Tensor:
    """The dynamic scheduler's counter ([2] int32: tile ids drawn past the first G, CTAs done)
    for a launch on the current stream: zero when the launch starts, and zeroed again by its
    last CTA (``_release_counter``). Eager launches share one a stream (stream order keeps
    them apart; a counter shared across streams would let concurrent launches take each other's
    tiles), kept from the first: a fresh ``torch.zeros`` a call took 20-30 us under cProfile
    (results/tune/host_graph_*_113e7bd_*.log). Under stream capture a new one, in the graph's
    pool (its captured zeroing runs at every replay). ``STREAM_COUNTERS`` off: a new one each
    launch (the earlier form)."""
    if not STREAM_COUNTERS or torch.cuda.is_current_stream_capturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    key = (device.index, current_stream(device.index))
    got = _COUNTERS.get(key)
    if got is None:
        got = _COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return got


def paged_unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: Optional[torch.Tensor], softcap: float, has_alibi: bool,
                             has_leftpad: bool, has_cache_idx: bool) -> str | None:
    """Why ``attn_fwd_sm90_paged`` does not cover a KV-cache call (None when it does): q [b, s_q,
    h, d] over a paged cache [pages, page_size, h_k, d] through block_table [b, width] int32.
    Head dims, features, dtypes and TMA views are the dense forward's (``unsupported_reason``;
    a page pool is TMA-readable as a batched [pages, page_size] tensor is)."""
    if block_table is None or has_cache_idx:
        return "the sm90 KV-cache forward reads paged caches (block_table), not cache_batch_idx"
    if has_leftpad:
        return "cache_leftpad is not covered by the sm90 KV-cache forward"
    if (q.shape[-1], v_cache.shape[-1]) in PADDED_HEAD_DIMS:
        return (f"head dims ({q.shape[-1]}, {v_cache.shape[-1]}): the sm90 KV-cache forward reads "
                f"caches in place, d = d_v in {SUPPORTED_HEAD_DIMS}")
    problem = unsupported_reason(q, k_cache, v_cache, q.shape[-1], v_cache.shape[-1], softcap,
                                 has_alibi, 0.0, False)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        problem = problem or base_problem(name, t)  # (caches are not copied to mend it)
    if problem is not None:
        return problem
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return "the sm90 KV-cache forward takes caches of q's dtype"
    page, block_n = k_cache.shape[1], _block_n(q.shape[-1])
    if page % 8 or (block_n % page and page % block_n):
        return (f"page_size {page}: the sm90 KV-cache forward loads whole pages per TMA copy "
                f"(a multiple of 8 that divides, or is a multiple of, {block_n} keys)")
    if block_table.stride(-1) != 1:
        return "block_table rows must be contiguous"
    return None


def attn_fwd_sm90_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, seqlens_k: torch.Tensor, softmax_scale: float,
                        window_left: int, window_right: int, out: torch.Tensor,
                        lse: torch.Tensor, softcap: float = 0.0) -> None:
    """The forward of q [b, s_q, h, d] over a paged KV cache, into out [b, s_q, h, d] (contiguous)
    and lse [b, h, s_q] fp32 (natural log): sequence i's keys are cache positions [0,
    seqlens_k[i]) (int32, on the device: no host sync), position p at page block_table[i, p //
    page_size], slot p % page_size; masks bottom-right aligned as the dense kernels. The producer
    issues one TMA copy per page run (``_key_tile_load``); the rest is the dense kernel.
    Covered calls: ``paged_unsupported_reason``."""
    b, s_q, h, d = q.shape
    h_k, page = k_cache.shape[2], k_cache.shape[1]
    grid = (-(-s_q // BLOCK_M.value), b * h)
    if grid[0] * grid[1] == 0:
        return
    block_n = _block_n(d)
    box = min(page, block_n)  # one TMA copy per page, or per tile when pages are larger
    k_desc = rows_descriptor(k_cache, False, box)  # [pages * page_size, h_k * d] rows
    v_desc = rows_descriptor(v_cache, False, box)
    q_desc = rows_descriptor(q, False, HALF_M.value)
    o_desc = rows_descriptor(out, False, HALF_M.value)
    qk_scale_log2, softcap_scale = score_scales(softmax_scale, softcap)
    launcher(_attn_fwd_sm90)[grid](
        q_desc, k_desc, v_desc, o_desc, out, lse, seqlens_k, seqlens_k, block_table,
        out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), block_table.stride(0),
        block_table.shape[1], h, h // h_k, s_q, block_table.shape[1] * page, b * h,
        qk_scale_log2, window_left, window_right, softcap_scale=softcap_scale,
        IS_VARLEN=False, HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0,
        STAGES=_stages(d), CONSUMER_REGS_=CONSUMER_REGS, PRODUCER_REGS_=PRODUCER_REGS,
        BLOCK_N=block_n, PAGED=True, PAGE=page, PINGPONG=_pingpong(d, 2), PERSISTENT=False,
        EXP_EARLY=_exp_early(d, False, mask_kind(window_left, window_right)),
        num_warps=4,
    )

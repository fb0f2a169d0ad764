"""Portable Triton backward (FA2-style recompute) and its launcher.

Three kernels: ``_bwd_preprocess`` (delta = rowsum(dO * O) - dLSE), ``_bwd_dkdv_kernel`` (one program
per key block and KV head; it loops over the query heads of its GQA group, so dK/dV are reduced
without materializing repeated K/V) and ``_bwd_dq_kernel`` (one program per query block and head).
No atomics anywhere, so every backward is deterministic (bitwise reproducible). On the H200 the
separate dQ kernel also beat fp32 atomic dQ accumulation from the dK/dV kernel: 425 vs 392
TFLOP/s at d=128 s=8k (benchmarks/NOTES.md), so there is no faster non-deterministic mode to offer.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ioattn.dense import configs
from ioattn.dense.common import (LOG2E, cdiv, dropout_keep, ensure_tma_allocator, kv_block_range,
                                 kv_sources, load_kv_block, q_block_range, scores_log2, seq_bounds, tma_compatible,
                                 visible)
from ioattn.dense.params import AttnParams
from ioattn.launch import launcher, repeat


@triton.jit
def _bwd_preprocess(O, DO, DLSE, DELTA,
                    stride_ob, stride_om, stride_oh, stride_db, stride_dm, stride_dh,
                    stride_lb, stride_lh, CU_Q, n_heads, seqlen_q_fixed,
                    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                    IS_VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads
    off_h = pid_bh % n_heads
    q_start, seqlen_q, _, _, _ = seq_bounds(CU_Q, CU_Q, off_b, seqlen_q_fixed, 0, IS_VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    rows = (q_start + offs_m).to(tl.int64)
    o = tl.load(O + off_b.to(tl.int64) * stride_ob + rows[:, None] * stride_om + off_h * stride_oh
                + offs_dv[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off_b.to(tl.int64) * stride_db + rows[:, None] * stride_dm + off_h * stride_dh
                 + offs_dv[None, :], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    l_off = off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + rows
    if HAS_DLSE:
        # a gradient flowing into the LSE output: d lse_i / d s_ij = P_ij, folded into delta
        delta -= tl.load(DLSE + l_off, mask=row_ok, other=0.0)
    tl.store(DELTA + l_off, delta, mask=row_ok)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qm, stride_dom,
                start, end, offs_m0, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, off,
                window_left, window_right, qk_scale_log2, softcap_scale, softcap_log2, slope_log2,
                seed, rng_row0, max_seqlen_k, dropout_p,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
                MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_DROPOUT: tl.constexpr, KEYS_AS_B: tl.constexpr, USE_TMA: tl.constexpr):
    # q_src / do_src: TMA descriptors (USE_TMA; rows past seqlen_q read as 0) or base pointers
    for start_m in tl.range(start, end, BLOCK_M):
        offs_m = start_m + offs_m0
        if USE_TMA:
            q = q_src.load([start_m, 0])
            do = do_src.load([start_m, 0])
        else:
            q_ptrs = q_src + offs_m[:, None] * stride_qm + offs_d[None, :]
            do_ptrs = do_src + offs_m[:, None] * stride_dom + offs_dv[None, :]
            if MASKED:
                row_ok = offs_m < seqlen_q
                q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
                do = tl.load(do_ptrs, mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
            elif EVEN_D:
                q = tl.load(q_ptrs)
                do = tl.load(do_ptrs)
            else:
                q = tl.load(q_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
                do = tl.load(do_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
        if MASKED:
            row_ok = offs_m < seqlen_q
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        # fully masked rows carry LSE = -inf; +inf makes their P exactly 0 instead of NaN
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        # KEYS_AS_B: scores [BLOCK_M, BLOCK_N] with K and V as the B operands (read from shared
        # memory), so K/V tiles need no registers; else transposed scores [BLOCK_N, BLOCK_M].
        if KEYS_AS_B:
            qk = tl.dot(q, tl.trans(k))
            rows = offs_m[:, None]
            cols = offs_n[None, :]
            lse_b = lse2[:, None]
            delta_b = delta[:, None]
        else:
            qk = tl.dot(k, tl.trans(q))
            rows = offs_m[None, :]
            cols = offs_n[:, None]
            lse_b = lse2[None, :]
            delta_b = delta[None, :]
        s, t, c = scores_log2(qk, rows, cols, off, qk_scale_log2, softcap_scale, softcap_log2,
                              slope_log2, HAS_SOFTCAP, HAS_ALIBI)
        if MASKED:
            s = tl.where(visible(rows, cols, seqlen_k, off, window_left, window_right,
                                 HAS_LEFT, HAS_RIGHT), s, float("-inf"))
        p = tl.exp2(s * c - lse_b)
        if KEYS_AS_B:
            dp = tl.dot(do, tl.trans(v))
        else:
            dp = tl.dot(v, tl.trans(do))
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_row0, rows, cols, max_seqlen_k, dropout_p)
            inv_keep = 1.0 / (1.0 - dropout_p)
            p_drop = tl.where(keep, p * inv_keep, 0.0)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        else:
            p_drop = p
        ds = p * (dp - delta_b)
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        if KEYS_AS_B:
            dv = tl.dot(tl.trans(p_drop.to(do.dtype)), do, dv)
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk)
        else:
            dv = tl.dot(p_drop.to(do.dtype), do, dv)
            dk = tl.dot(ds.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, SLOPES, CU_Q, CU_K, RNG,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lb, stride_lh, stride_sb,
    n_heads_k, kv_group, seqlen_q_fixed, seqlen_k_fixed, rng_rows, max_seqlen_k,
    sm_scale, qk_scale_log2, softcap_scale, softcap_log2, window_left, window_right, dropout_p,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    KEYS_AS_B: tl.constexpr, USE_TMA: tl.constexpr,
):
    EVEN_D: tl.constexpr = (BLOCK_D == HEAD_DIM) and (BLOCK_DV == HEAD_DIM_V)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads_k
    off_hk = pid_bh % n_heads_k
    q_start, seqlen_q, k_start, seqlen_k, rng_q0 = seq_bounds(CU_Q, CU_K, off_b, seqlen_q_fixed,
                                                              seqlen_k_fixed, IS_VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= seqlen_k:
        return
    off_b64 = off_b.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < seqlen_k
    k_rows = (k_start + offs_n).to(tl.int64)
    k = tl.load(K + off_b64 * stride_kb + k_rows[:, None] * stride_kn + off_hk.to(tl.int64) * stride_kh
                + offs_d[None, :], mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    v = tl.load(V + off_b64 * stride_vb + k_rows[:, None] * stride_vn + off_hk.to(tl.int64) * stride_vh
                + offs_dv[None, :], mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    off = seqlen_k - seqlen_q
    lo, full_lo, full_hi, hi = q_block_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                             BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(RNG)
    for g in range(kv_group):
        off_h = (off_hk * kv_group + g).to(tl.int64)
        q_base = Q + off_b64 * stride_qb + q_start.to(tl.int64) * stride_qm + off_h * stride_qh
        do_base = DO + off_b64 * stride_dob + q_start.to(tl.int64) * stride_dom + off_h * stride_doh
        if USE_TMA:
            q_src = tl.make_tensor_descriptor(q_base, shape=[seqlen_q, HEAD_DIM], strides=[stride_qm, 1],
                                              block_shape=[BLOCK_M, BLOCK_D])
            do_src = tl.make_tensor_descriptor(do_base, shape=[seqlen_q, HEAD_DIM_V],
                                               strides=[stride_dom, 1], block_shape=[BLOCK_M, BLOCK_DV])
        else:
            q_src = q_base
            do_src = do_base
        l_off = off_b64 * stride_lb + off_h * stride_lh + q_start
        slope_log2 = 0.0
        if HAS_ALIBI:
            slope_log2 = tl.load(SLOPES + off_b * stride_sb + off_h).to(tl.float32) * 1.4426950408889634
        rng_row0 = 0
        if HAS_DROPOUT:
            rng_row0 = off_h * rng_rows + rng_q0 + tl.load(RNG + 1)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, LSE + l_off, DELTA + l_off, stride_qm,
                             stride_dom, lo, full_lo, offs_m0, offs_n, offs_d, offs_dv, seqlen_q,
                             seqlen_k, off, window_left, window_right, qk_scale_log2, softcap_scale,
                             softcap_log2, slope_log2, seed, rng_row0, max_seqlen_k, dropout_p,
                             HEAD_DIM, HEAD_DIM_V, BLOCK_M, True, EVEN_D, HAS_LEFT, HAS_RIGHT,
                             HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, KEYS_AS_B, USE_TMA)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, LSE + l_off, DELTA + l_off, stride_qm,
                             stride_dom, full_lo, full_hi, offs_m0, offs_n, offs_d, offs_dv, seqlen_q,
                             seqlen_k, off, window_left, window_right, qk_scale_log2, softcap_scale,
                             softcap_log2, slope_log2, seed, rng_row0, max_seqlen_k, dropout_p,
                             HEAD_DIM, HEAD_DIM_V, BLOCK_M, False, EVEN_D, HAS_LEFT, HAS_RIGHT,
                             HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, KEYS_AS_B, USE_TMA)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, LSE + l_off, DELTA + l_off, stride_qm,
                             stride_dom, full_hi, hi, offs_m0, offs_n, offs_d, offs_dv, seqlen_q,
                             seqlen_k, off, window_left, window_right, qk_scale_log2, softcap_scale,
                             softcap_log2, slope_log2, seed, rng_row0, max_seqlen_k, dropout_p,
                             HEAD_DIM, HEAD_DIM_V, BLOCK_M, True, EVEN_D, HAS_LEFT, HAS_RIGHT,
                             HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, KEYS_AS_B, USE_TMA)
    dk = dk * sm_scale
    mask_k = col_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    mask_v = col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(DK + off_b64 * stride_dkb + k_rows[:, None] * stride_dkn + off_hk.to(tl.int64) * stride_dkh
             + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=mask_k)
    tl.store(DV + off_b64 * stride_dvb + k_rows[:, None] * stride_dvn + off_hk.to(tl.int64) * stride_dvh
             + offs_dv[None, :], dv.to(DV.dtype.element_ty), mask=mask_v)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn,
              start, end, offs_m, offs_n0, offs_d, offs_dv, seqlen_k, off,
              window_left, window_right, qk_scale_log2, softcap_scale, softcap_log2, slope_log2,
              seed, rng_row0, max_seqlen_k, dropout_p,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr):
    # k_src / v_src: from kv_sources (TMA descriptors or pointer blocks)
    for start_n in tl.range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        k = load_kv_block(k_src, start_n, stride_kn, offs_n, offs_d, seqlen_k, HEAD_DIM, MASKED, EVEN_D,
                          USE_TMA)
        v = load_kv_block(v_src, start_n, stride_vn, offs_n, offs_dv, seqlen_k, HEAD_DIM_V, MASKED,
                          EVEN_D, USE_TMA)
        qk = tl.dot(q, tl.trans(k))
        s, t, c = scores_log2(qk, offs_m[:, None], offs_n[None, :], off, qk_scale_log2, softcap_scale,
                              softcap_log2, slope_log2, HAS_SOFTCAP, HAS_ALIBI)
        if MASKED:
            s = tl.where(visible(offs_m[:, None], offs_n[None, :], seqlen_k, off, window_left,
                                 window_right, HAS_LEFT, HAS_RIGHT), s, float("-inf"))
        p = tl.exp2(s * c - lse2[:, None])
        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_row0, offs_m[:, None], offs_n[None, :], max_seqlen_k, dropout_p)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, SLOPES, CU_Q, CU_K, RNG,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_sb,
    n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed, rng_rows, max_seqlen_k,
    sm_scale, qk_scale_log2, softcap_scale, softcap_log2, window_left, window_right, dropout_p,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    EVEN_D: tl.constexpr = (BLOCK_D == HEAD_DIM) and (BLOCK_DV == HEAD_DIM_V)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads
    off_h = pid_bh % n_heads
    off_hk = off_h // kv_group
    q_start, seqlen_q, k_start, seqlen_k, rng_q0 = seq_bounds(CU_Q, CU_K, off_b, seqlen_q_fixed,
                                                              seqlen_k_fixed, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    off_b64 = off_b.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + off_b64 * stride_qb + rows[:, None] * stride_qm + off_h.to(tl.int64) * stride_qh
                + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    do = tl.load(DO + off_b64 * stride_dob + rows[:, None] * stride_dom + off_h.to(tl.int64) * stride_doh
                 + offs_dv[None, :], mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    l_off = off_b64 * stride_lb + off_h.to(tl.int64) * stride_lh + rows
    lse = tl.load(LSE + l_off, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + l_off, mask=row_ok, other=0.0)
    k_base = K + off_b64 * stride_kb + k_start.to(tl.int64) * stride_kn + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b64 * stride_vb + k_start.to(tl.int64) * stride_vn + off_hk.to(tl.int64) * stride_vh
    k_src, v_src = kv_sources(k_base, v_base, seqlen_k, stride_kn, stride_vn, offs_n0, offs_d, offs_dv,
                              HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA)
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(SLOPES + off_b * stride_sb + off_h).to(tl.float32) * 1.4426950408889634
    seed = 0
    rng_row0 = 0
    if HAS_DROPOUT:
        seed = tl.load(RNG)
        rng_row0 = off_h.to(tl.int64) * rng_rows + rng_q0 + tl.load(RNG + 1)
    off = seqlen_k - seqlen_q
    lo, full_lo, full_hi, hi = kv_block_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                              BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, lo, full_lo, offs_m,
                   offs_n0, offs_d, offs_dv, seqlen_k, off, window_left, window_right, qk_scale_log2,
                   softcap_scale, softcap_log2, slope_log2, seed, rng_row0, max_seqlen_k, dropout_p,
                   HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                   HAS_ALIBI, HAS_DROPOUT, USE_TMA)
    dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, full_lo, full_hi,
                   offs_m, offs_n0, offs_d, offs_dv, seqlen_k, off, window_left, window_right,
                   qk_scale_log2, softcap_scale, softcap_log2, slope_log2, seed, rng_row0,
                   max_seqlen_k, dropout_p,
                   HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                   HAS_ALIBI, HAS_DROPOUT, USE_TMA)
    dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, full_hi, hi, offs_m,
                   offs_n0, offs_d, offs_dv, seqlen_k, off, window_left, window_right, qk_scale_log2,
                   softcap_scale, softcap_log2, slope_log2, seed, rng_row0, max_seqlen_k, dropout_p,
                   HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                   HAS_ALIBI, HAS_DROPOUT, USE_TMA)
    dq = dq * sm_scale
    tl.store(DQ + off_b64 * stride_dqb + rows[:, None] * stride_dqm + off_h.to(tl.int64) * stride_dqh
             + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


def bwd_preprocess(p: AttnParams, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                   dlse: Optional[torch.Tensor], delta: torch.Tensor, key=None):
    """delta = rowsum(dO * O) - dLSE into ``delta`` (LSE's layout); shared by every backward.
    ``key``: as ``attn_bwd``'s (the launch kept under it, slots O, dO, dLSE, delta; the kept
    ``Bound`` is returned, None without a key or where it cannot be bound)."""
    n_heads = out.shape[-2]
    sb = p.batch_strides
    pre_block = 64
    grid = (cdiv(p.max_seqlen_q, pre_block), p.batch * n_heads)
    if grid[0] * grid[1] == 0:
        return None
    args = (out, dout, dlse if dlse is not None else delta, delta,
            sb(out), out.stride(-3), out.stride(-2), sb(dout), dout.stride(-3), dout.stride(-2),
            *p.lse_strides(lse), p.cu_q_arg(out), n_heads, p.max_seqlen_q)
    kwargs = dict(HEAD_DIM_V=p.head_dim_v, BLOCK_DV=configs.pad_dim(p.head_dim_v),
                  BLOCK_M=pre_block, IS_VARLEN=p.is_varlen, HAS_DLSE=dlse is not None)
    if key is None:
        launcher(_bwd_preprocess)[grid](*args, **kwargs)
        return None
    return launcher(_bwd_preprocess).bind_kept(_BOUND, key, grid, args, kwargs, (0, 1, 2, 3))


# (``attn_bwd``'s ``key``) its three launches kept for repeats, under (key, 0 / 1 / 2)
_BOUND: dict = {}


def attn_bwd(p: AttnParams, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
             dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, delta: torch.Tensor,
             key=None) -> None:
    """Launch the backward into preallocated dq/dk/dv (layouts of q/k/v) and ``delta`` (LSE's
    layout).

    ``key`` (the op's ``BIND``; params that hold no tensor): everything the three launches'
    arguments derive from but the addresses of the tensors passed here (shapes, strides,
    dtypes, device, the params' scalars, each pointer's 16-byte alignment, whether dLSE is
    given). The first call keeps its launches (``launch.Bound``: preprocess, dK/dV, dQ); a
    repeat is three C calls with this call's addresses. The stand-in pointers for absent
    ALiBi slopes, cu_seqlens and RNG state keep the first call's q (or O) address, never read."""
    if key is not None:  # (the config table too: tuning swaps it between calls of one form)
        key = (key, configs.bwd_config)
    if key is not None and (key, 2) in _BOUND:
        pre = (out.data_ptr(), dout.data_ptr(),
               (dlse if dlse is not None else delta).data_ptr(), delta.data_ptr())
        common = (q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), lse.data_ptr(),
                  delta.data_ptr())
        # (a Bound steps aside for all three alike: launch hooks, Triton's switches or the
        # device changed; the plain path below then runs them all again, delta's too)
        if repeat(_BOUND, (key, 0), *pre) and repeat(_BOUND, (key, 1), *common, dk.data_ptr(),
                                                     dv.data_ptr()) \
                and repeat(_BOUND, (key, 2), *common, dq.data_ptr()):
            return
    cfg = configs.bwd_config(q.device, p.head_dim, p.head_dim_v, q.dtype, p.causal_like)
    n_heads, n_heads_k = q.shape[-2], k.shape[-2]
    sb = p.batch_strides
    lse_strides = p.lse_strides(lse)
    block_d, block_dv = configs.pad_dim(p.head_dim), configs.pad_dim(p.head_dim_v)
    flags = dict(IS_VARLEN=p.is_varlen, HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0,
                 HAS_SOFTCAP=p.softcap > 0, HAS_ALIBI=p.alibi_slopes is not None,
                 HAS_DROPOUT=p.dropout_p > 0)
    scalars = (p.softmax_scale, p.softmax_scale * LOG2E,
               p.softmax_scale / p.softcap if p.softcap > 0 else 0.0, p.softcap * LOG2E,
               p.window_left, p.window_right, p.dropout_p)
    use_tma = cfg.tma and tma_compatible(q, k, v, dout)
    if use_tma:
        ensure_tma_allocator()
    pre_block = 64
    grid_q = (cdiv(p.max_seqlen_q, pre_block), p.batch * n_heads)
    grid_kv = (cdiv(p.max_seqlen_k, cfg.block_n), p.batch * n_heads_k)
    grid_dq = (cdiv(p.max_seqlen_q, cfg.block_m_dq), p.batch * n_heads)
    if grid_kv[0] * grid_kv[1] == 0:  # no keys: every dQ is 0, dK/dV are empty
        dq.zero_()
        return
    if grid_q[0] * grid_q[1] == 0:  # no queries: dK/dV are 0
        dk.zero_()
        dv.zero_()
        return
    if use_tma:
        key = None  # (device-side TMA takes scratch memory: never bound)
    bwd_preprocess(p, out, dout, lse, dlse, delta, None if key is None else (key, 0))
    dkdv_args = (
        q, k, v, dout, lse, delta, dk, dv, p.alibi_arg(q), p.cu_q_arg(q), p.cu_k_arg(q),
        p.rng_arg(q),
        sb(q), q.stride(-3), q.stride(-2),
        sb(k), k.stride(-3), k.stride(-2),
        sb(v), v.stride(-3), v.stride(-2),
        sb(dout), dout.stride(-3), dout.stride(-2),
        sb(dk), dk.stride(-3), dk.stride(-2),
        sb(dv), dv.stride(-3), dv.stride(-2),
        *lse_strides, p.alibi_batch_stride,
        n_heads_k, n_heads // n_heads_k, p.max_seqlen_q, p.max_seqlen_k, p.rng_rows, p.max_seqlen_k,
        *scalars)
    dkdv_kwargs = dict(
        HEAD_DIM=p.head_dim, HEAD_DIM_V=p.head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KEYS_AS_B=cfg.keys_as_b, USE_TMA=use_tma,
        **flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    dq_args = (
        q, k, v, dout, lse, delta, dq, p.alibi_arg(q), p.cu_q_arg(q), p.cu_k_arg(q), p.rng_arg(q),
        sb(q), q.stride(-3), q.stride(-2),
        sb(k), k.stride(-3), k.stride(-2),
        sb(v), v.stride(-3), v.stride(-2),
        sb(dout), dout.stride(-3), dout.stride(-2),
        sb(dq), dq.stride(-3), dq.stride(-2),
        *lse_strides, p.alibi_batch_stride,
        n_heads, n_heads // n_heads_k, p.max_seqlen_q, p.max_seqlen_k, p.rng_rows, p.max_seqlen_k,
        *scalars)
    dq_kwargs = dict(
        HEAD_DIM=p.head_dim, HEAD_DIM_V=p.head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=cfg.block_m_dq, BLOCK_N=cfg.block_n_dq, USE_TMA=use_tma, **flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if key is None:
        launcher(_bwd_dkdv_kernel)[grid_kv](*dkdv_args, **dkdv_kwargs)
        launcher(_bwd_dq_kernel)[grid_dq](*dq_args, **dq_kwargs)
    else:  # (slots: the tensors passed here; the stand-ins keep the first call's)
        launcher(_bwd_dkdv_kernel).bind_kept(_BOUND, (key, 1), grid_kv, dkdv_args, dkdv_kwargs,
                                             tuple(range(8)))
        launcher(_bwd_dq_kernel).bind_kept(_BOUND, (key, 2), grid_dq, dq_args, dq_kwargs,
                                           tuple(range(7)))

"""Portable Triton kernels for attention over a KV cache (decode, speculative verification, chunked
prefill onto a cache) and their launchers.

- ``_kvcache_attn_kernel``: split-KV attention. One program takes a split (a range of cache
  positions) for one KV head of one sequence and *all* query rows that read that head: the s_q
  tokens times the GQA group are packed into the tile's M dimension (row r is token r // group,
  query head kv_head * group + r % group), so GQA decode runs on the tensor cores and each K/V
  tile is read once for the whole group. Keys are addressed through a page table with any page
  size (position p lives in page block_table[b, p // page_size], slot p % page_size), or in a
  contiguous cache row (cache_batch_idx).
- ``_combine_kernel``: merges the splits' partial outputs by their LSEs.
- ``_rope_store_kernel``: writes new k/v tokens into the cache (paged or contiguous), rotating k
  (and q, into a new tensor) with rotary embeddings, interleaved or not.
- ``_pack_offsets_kernel`` and ``_gather_kv_kernel``: copy each sequence's keys out of the cache
  into packed varlen K/V, for long query chunks that run in the dense forward instead
  (``ioattn.decode.op.gathers``).

Masks follow the dense kernels: with L keys in [leftpad, seqlen_k), query token i of s_q sees cache
position p iff p in [leftpad, seqlen_k) and i + off - left <= p <= i + off + right, off = seqlen_k -
s_q (bottom-right aligned).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ioattn.dense.common import LOG2E, cdiv, scores_log2
from ioattn.dispatch import sm90_unavailable_reason, sm_count
from ioattn.launch import keep, launcher


@triton.jit
def _cache_slots(BT, CACHE_IDX, off_b, bt_row, pos, mask, page_size, n_pages,
                 PAGED: tl.constexpr, HAS_CACHE_IDX: tl.constexpr):
    """(page, slot) of cache positions ``pos``: paged caches through the block table, contiguous
    caches as one page per sequence (row cache_batch_idx[b], or b). Callers keep pos below the
    capacity; page indices are clamped into the cache, so unchecked indices (CUDA graph replay)
    can give wrong numbers but never an access outside the cache."""
    if PAGED:
        page = tl.load(BT + bt_row + pos // page_size, mask=mask, other=0)
        slot = pos % page_size
    else:
        if HAS_CACHE_IDX:
            page = tl.load(CACHE_IDX + off_b) + pos * 0
        else:
            page = off_b + pos * 0
        slot = pos
    page = tl.minimum(tl.maximum(page, 0), n_pages - 1)
    return page.to(tl.int64), slot


@triton.jit
def _rope_halves(x1, x2, pos, inv_freq):
    """Rotate (x1, x2), the two halves of [rows, d] vectors at positions ``pos`` [rows], by the
    angles pos * inv_freq (GPT-NeoX / Llama layout); computed in fp32, returned in x's dtype."""
    ang = pos[:, None] * inv_freq[None, :]
    c = tl.cos(ang)
    s = tl.sin(ang)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    return (a * c - b * s).to(x1.dtype), (b * c + a * s).to(x1.dtype)


@triton.jit
def _kvcache_attn_kernel(
    Q, K, V, O, LSE, O_PART, LSE_PART, SEQLENS_K, LEFTPAD, BT, CACHE_IDX, SLOPES, WORK, N_WORK,
    stride_qb, stride_qs, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_btb, stride_sb,
    seqlen_q, n_heads_k, kv_group, page_size, n_pages, capacity, split_len, n_splits, batch,
    qk_scale_log2, softcap_scale, softcap_log2, window_left, window_right,
    rope_rcp_scale, rope_log2_theta, MASK, MASK_INDPTR,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, HAS_CACHE_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, SPLIT: tl.constexpr, WORKLIST: tl.constexpr, CSR: tl.constexpr,
    LSE_BASE2: tl.constexpr = False, ROPE: tl.constexpr = False, BLOCK_HD: tl.constexpr = 16,
    HAS_MASK: tl.constexpr = False,
):
    i_m = tl.program_id(1)
    if WORKLIST:
        # planned work (plan()/run()): item w = (request, first row block, first key, end key,
        # partial slot or -1); the grid is sized for the most items a plan may produce, the rest
        # exit here. Queries are ragged: request b's rows are [qo_indptr[b], qo_indptr[b + 1]) of
        # q [total_q, h, d] (decode: one row each); plan() stores, after the kv lengths, the kv
        # indptr and the qo indptr in SEQLENS_K.
        w = tl.program_id(0)
        if w >= tl.load(N_WORK):
            return
        off_b = tl.load(WORK + 5 * w)
        i_m += tl.load(WORK + 5 * w + 1)
        w_lo = tl.load(WORK + 5 * w + 2)
        w_hi = tl.load(WORK + 5 * w + 3)
        part = tl.load(WORK + 5 * w + 4)
        off_hk = tl.program_id(2)
        q_row0 = tl.load(SEQLENS_K + 2 * batch + 1 + off_b)
        seqlen_q = tl.load(SEQLENS_K + 2 * batch + 2 + off_b) - q_row0
        q_row0 = q_row0.to(tl.int64)
        if i_m * BLOCK_M >= seqlen_q * kv_group:
            return  # (a grid sized on the device: row blocks past this request's rows)
    else:
        i_split = tl.program_id(0)
        i_bh = tl.program_id(2)
        off_b = i_bh // n_heads_k
        off_hk = i_bh % n_heads_k
    seqlen_k = tl.minimum(tl.load(SEQLENS_K + off_b), capacity)
    # the sequence's page-table row: a row of a dense [batch, pages] table, or a CSR segment
    if CSR:
        bt_row = tl.load(SEQLENS_K + batch + off_b).to(tl.int64)  # plan() stores indptr there
    else:
        bt_row = off_b.to(tl.int64) * stride_btb
    leftpad = 0
    if HAS_LEFTPAD:
        leftpad = tl.load(LEFTPAD + off_b)
    off = seqlen_k - seqlen_q

    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed rows: token r // group, head r % group
    o_tok = o_r // kv_group
    o_head = off_hk * kv_group + o_r % kv_group
    m_row = o_r < seqlen_q * kv_group
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    # [BLOCK_M, BLOCK_D]
    if WORKLIST:
        q_base = Q + q_row0 * stride_qs
    else:
        q_base = Q + off_b.to(tl.int64) * stride_qb
    p_q_row = q_base + o_tok.to(tl.int64) * stride_qs + o_head.to(tl.int64) * stride_qh  # [BLOCK_M]
    if ROPE:
        # RoPE inside attention (FlashInfer's ROPE_LLAMA): the cache holds unrotated keys; q and
        # each K tile rotate in registers (halves of the head dim), and QK^T is the sum of the
        # two half products. Query token i sits at position seqlen_k - seqlen_q + i.
        HALF_D: tl.constexpr = HEAD_DIM // 2
        o_hd = tl.arange(0, BLOCK_HD)
        m_hd = o_hd < HALF_D
        inv_freq = rope_rcp_scale * tl.exp2(-(2.0 * o_hd.to(tl.float32) / HEAD_DIM) * rope_log2_theta)
        p_q1 = p_q_row[:, None] + o_hd[None, :]
        m_q = m_row[:, None] & m_hd[None, :]
        b_q1, b_q2 = _rope_halves(tl.load(p_q1, mask=m_q, other=0.0),
                                  tl.load(p_q1 + HALF_D, mask=m_q, other=0.0),
                                  (off + o_tok).to(tl.float32), inv_freq)
    else:
        b_q = tl.load(p_q_row[:, None] + o_d[None, :], mask=m_row[:, None] & m_d[None, :], other=0.0)
        if K.dtype.element_ty.is_fp8():
            # an fp8 cache is multiplied in fp16: e4m3/e5m2 -> fp16 is one cvt per pair of values
            # where bf16 takes three (sm90 PTX; benchmarks/NOTES.md: 1.50 -> 1.81 TB/s at 64x4k
            # with the tile change). q is scaled by a power of two so that its largest |value|
            # fits fp16 (<= 2^15), which the score scales undo exactly.
            q_abs = tl.abs(b_q.to(tl.float32))  # (finite values: an inf poisons its row only)
            q_amax = tl.max(tl.max(tl.where(q_abs < float("inf"), q_abs, 0.0), 1), 0)
            q_exp = tl.maximum(tl.ceil(tl.log2(q_amax)) - 15.0, 0.0)
            b_q = (b_q.to(tl.float32) * tl.exp2(-q_exp)).to(tl.float16)
            qk_scale_log2 = qk_scale_log2 * tl.exp2(q_exp)
            softcap_scale = softcap_scale * tl.exp2(q_exp)

    # this split's cache positions, cut to what some row of the tile may see
    if WORKLIST:
        lo = w_lo
        hi = tl.minimum(w_hi, seqlen_k)
    else:
        lo = leftpad + i_split * split_len
        hi = tl.minimum(lo + split_len, seqlen_k)
    first_tok = (i_m * BLOCK_M) // kv_group
    last_tok = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // kv_group, seqlen_q - 1)
    if HAS_RIGHT:
        hi = tl.minimum(hi, last_tok + off + window_right + 1)
    if HAS_LEFT:
        lo = tl.maximum(lo, first_tok + off - window_left)

    slope_log2 = tl.zeros([BLOCK_M, 1], tl.float32)
    if HAS_ALIBI:
        slope_log2 = tl.load(SLOPES + off_b * stride_sb + o_head[:, None], mask=m_row[:, None],
                             other=0.0).to(tl.float32) * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        o_p = start + tl.arange(0, BLOCK_N)
        m_p = o_p < hi
        page, slot = _cache_slots(BT, CACHE_IDX, off_b, bt_row, o_p, m_p, page_size, n_pages,
                                  PAGED, HAS_CACHE_IDX)
        # [BLOCK_N, BLOCK_D]
        p_k_row = K + page * stride_kp + slot.to(tl.int64) * stride_ks + off_hk.to(tl.int64) * stride_kh
        if ROPE:
            p_k1 = p_k_row[:, None] + o_hd[None, :]
            m_k = m_p[:, None] & m_hd[None, :]
            # (an fp8 cache is upcast to q's dtype as it is loaded)
            b_k1, b_k2 = _rope_halves(tl.load(p_k1, mask=m_k, other=0.0).to(b_q1.dtype),
                                      tl.load(p_k1 + HALF_D, mask=m_k, other=0.0).to(b_q1.dtype),
                                      o_p.to(tl.float32), inv_freq)
            # [BLOCK_M, BLOCK_N]
            qk = tl.dot(b_q1, tl.trans(b_k1))
            qk = tl.dot(b_q2, tl.trans(b_k2), qk)
        else:
            # an fp8 cache (FlashInfer's kv_data_type) is upcast to q's dtype as it is loaded;
            # its scales are applied outside (k_scale in the softmax scale, v_scale on out)
            b_k = tl.load(p_k_row[:, None] + o_d[None, :], mask=m_p[:, None] & m_d[None, :],
                          other=0.0).to(b_q.dtype)
            # [BLOCK_M, BLOCK_N]
            qk = tl.dot(b_q, tl.trans(b_k))
        s, _, c = scores_log2(qk, o_tok[:, None], o_p[None, :], off, qk_scale_log2, softcap_scale,
                              softcap_log2, slope_log2, HAS_SOFTCAP, HAS_ALIBI)
        vis = m_p[None, :] & (o_p[None, :] >= leftpad)
        if HAS_RIGHT:
            vis = vis & (o_p[None, :] <= o_tok[:, None] + off + window_right)
        if HAS_LEFT:
            vis = vis & (o_p[None, :] >= o_tok[:, None] + off - window_left)
        s = tl.where(vis, s, float("-inf"))
        if HAS_MASK:
            # FlashInfer's packed custom mask: request b's [qo_len, kv_len] booleans, row-major,
            # bits little-endian from byte MASK_INDPTR[b]
            bit = o_tok[:, None].to(tl.int64) * seqlen_k + o_p[None, :]
            mask_byte0 = tl.load(MASK_INDPTR + off_b).to(tl.int64)
            byte = tl.load(MASK + mask_byte0 + (bit >> 3), mask=m_row[:, None] & m_p[None, :], other=0)
            s = tl.where(((byte.to(tl.int32) >> (bit & 7).to(tl.int32)) & 1) != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * c)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * c - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        p_v = (V + page[:, None] * stride_vp + slot[:, None].to(tl.int64) * stride_vs
               + off_hk.to(tl.int64) * stride_vh + o_d[None, :])
        # (fp16 products for an fp8 cache without RoPE, as QKᵀ: P in [0, 1] loses nothing)
        b_v = tl.load(p_v, mask=m_p[:, None] & m_d[None, :], other=0.0).to(
            tl.float16 if K.dtype.element_ty.is_fp8() and not ROPE else Q.dtype.element_ty)
        acc = tl.dot(p.to(b_v.dtype), b_v, acc * alpha[:, None])
        m_i = m_new

    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    if not LSE_BASE2:
        lse = lse * 0.6931471805599453  # natural log (FlashAttention's convention)
    if WORKLIST:
        # a decode request split over several items writes partials to its slots (O_PART
        # [slots, h, d], LSE_PART [slots, h]); otherwise rows go to out [total_q, h, d] and the
        # LSE to [total_q, h]
        if part >= 0:
            row = part.to(tl.int64) * (n_heads_k * kv_group) + o_head
            tl.store(O_PART + row[:, None] * HEAD_DIM + o_d[None, :], acc,
                     mask=m_row[:, None] & m_d[None, :])
            tl.store(LSE_PART + row, lse, mask=m_row)
        else:
            rows = q_row0 + o_tok
            p_o = O + rows[:, None] * stride_os + o_head[:, None].to(tl.int64) * stride_oh + o_d[None, :]
            tl.store(p_o, acc.to(O.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])
            tl.store(LSE + rows * (n_heads_k * kv_group) + o_head, lse, mask=m_row)
    elif SPLIT:
        # partials: O_PART [splits, batch, s_q, h, d] fp32, LSE_PART [splits, batch, h, s_q]
        row = ((i_split * batch + off_b) * seqlen_q + o_tok).to(tl.int64) * (n_heads_k * kv_group) + o_head
        tl.store(O_PART + row[:, None] * HEAD_DIM + o_d[None, :], acc,
                 mask=m_row[:, None] & m_d[None, :])
        l_row = ((i_split * batch + off_b) * (n_heads_k * kv_group) + o_head).to(tl.int64) * seqlen_q + o_tok
        tl.store(LSE_PART + l_row, lse, mask=m_row)
    else:
        p_o = (O + off_b.to(tl.int64) * stride_ob + o_tok[:, None].to(tl.int64) * stride_os
               + o_head[:, None].to(tl.int64) * stride_oh + o_d[None, :])
        tl.store(p_o, acc.to(O.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])
        l_row = (off_b * (n_heads_k * kv_group) + o_head).to(tl.int64) * seqlen_q + o_tok
        tl.store(LSE + l_row, lse, mask=m_row)


@triton.jit
def _merge_slots(O_PART, LSE_PART, o_row0, l_row0, o_slot_stride, l_slot_stride, first, last,
                 LSE_IN_BASE2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_S: tl.constexpr):
    """Merge one head's partials s in [first, last) by their LSE: partial s's output row is
    o_row0 + s * o_slot_stride of O_PART [rows, HEAD_DIM] (fp32, normalized) and its LSE
    LSE_PART[l_row0 + s * l_slot_stride]. BLOCK_S partials per step, loaded together (a serial
    walk over the partials made the merge latency-bound: 31 us for 33 splits at 1x32k).
    Returns (output [BLOCK_D], base-2 LSE); a head with nothing gives 0 and -inf."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(first, last, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        ok = o_s < last
        lse = tl.load(LSE_PART + l_row0 + o_s.to(tl.int64) * l_slot_stride, mask=ok,
                      other=float("-inf"))
        if not LSE_IN_BASE2:
            lse = lse * 1.4426950408889634
        o = tl.load(O_PART + (o_row0 + o_s.to(tl.int64) * o_slot_stride)[:, None] * HEAD_DIM
                    + o_d[None, :], mask=ok[:, None] & m_d[None, :], other=0.0)
        m_new = tl.maximum(m_i, tl.max(lse, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - m_use)  # empty partials (LSE -inf) weigh 0
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)
    return out, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))


@triton.jit
def _combine_kernel(O, LSE, O_PART, LSE_PART, stride_ob, stride_os, stride_oh,
                    seqlen_q, n_heads, n_splits, batch,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One (batch, token, head): out = sum_s exp(lse_s - lse) * o_s over the splits of O_PART
    [splits, batch, s_q, h, d] and LSE_PART [splits, batch, h, s_q] (natural log)."""
    i_bt = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = i_bt // seqlen_q
    i_tok = i_bt % seqlen_q
    acc, lse2 = _merge_slots(O_PART, LSE_PART, (i_bt * n_heads + off_h).to(tl.int64),
                             ((off_b * n_heads + off_h) * seqlen_q + i_tok).to(tl.int64),
                             batch * seqlen_q * n_heads, batch * n_heads * seqlen_q, 0, n_splits,
                             False, HEAD_DIM, BLOCK_D, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    p_o = (O + off_b.to(tl.int64) * stride_ob + i_tok.to(tl.int64) * stride_os
           + off_h.to(tl.int64) * stride_oh + o_d)
    tl.store(p_o, acc.to(O.dtype.element_ty), mask=o_d < HEAD_DIM)
    tl.store(LSE + (off_b * n_heads + off_h).to(tl.int64) * seqlen_q + i_tok + tl.arange(0, 1),
             lse2 * 0.6931471805599453)


@triton.jit
def _combine_slots_kernel(O, LSE, O_PART, LSE_PART, SLOT_START, stride_ob, stride_oh, n_heads,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                          LSE_BASE2: tl.constexpr):
    """Decode request b split over slots [SLOT_START[b], SLOT_START[b + 1]) (none when the
    request ran as one item and wrote its output itself): merge one head's partials by LSE
    (O_PART [slots, h, d], LSE_PART [slots, h])."""
    off_b = tl.program_id(0)
    off_h = tl.program_id(1)
    first = tl.load(SLOT_START + off_b)
    last = tl.load(SLOT_START + off_b + 1)
    if last <= first:
        return
    acc, lse2 = _merge_slots(O_PART, LSE_PART, off_h.to(tl.int64), off_h.to(tl.int64), n_heads,
                             n_heads, first, last, LSE_BASE2, HEAD_DIM, BLOCK_D, BLOCK_S)
    lse = lse2 if LSE_BASE2 else lse2 * 0.6931471805599453
    o_d = tl.arange(0, BLOCK_D)
    tl.store(O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh + o_d,
             acc.to(O.dtype.element_ty), mask=o_d < HEAD_DIM)
    tl.store(LSE + off_b.to(tl.int64) * n_heads + off_h + tl.arange(0, 1), lse)


@triton.jit
def _rope_store_kernel(SRC, DST, COS, SIN, POS_BASE, LEFTPAD, BT, CACHE_IDX,
                       stride_sb, stride_ss, stride_sh,
                       stride_dp, stride_ds, stride_dh,
                       stride_cos, rot_rows, stride_btb, seqlen, page_size, n_pages, capacity,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROT_HALF: tl.constexpr,
                       BLOCK_R: tl.constexpr, HAS_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
                       PER_TOKEN_POS: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
                       TO_CACHE: tl.constexpr, PAGED: tl.constexpr, HAS_CACHE_IDX: tl.constexpr):
    """Token t of sequence b, one head: DST <- rotary(SRC[b, t, h]) (or a plain copy).

    TO_CACHE: DST is a cache and the token goes to position POS_BASE[b] + t (paged or contiguous);
    else DST is [b, s, h, d] like SRC. Rotary position: POS_BASE[b] - leftpad[b] (+ t when
    PER_TOKEN_POS); cos/sin rows of ROT_HALF = rotary_dim / 2 values.
    """
    i_bt = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = i_bt // seqlen
    i_tok = i_bt % seqlen
    base = tl.load(POS_BASE + off_b)
    src = SRC + off_b.to(tl.int64) * stride_sb + i_tok.to(tl.int64) * stride_ss + off_h.to(tl.int64) * stride_sh
    if TO_CACHE:
        pos = base + i_tok
        if pos >= capacity:  # only reachable with unchecked cache_seqlens (graph replay): drop it
            return
        page, slot = _cache_slots(BT, CACHE_IDX, off_b, off_b.to(tl.int64) * stride_btb, pos,
                                  pos >= 0, page_size, n_pages, PAGED, HAS_CACHE_IDX)
        dst = DST + page * stride_dp + slot.to(tl.int64) * stride_ds + off_h.to(tl.int64) * stride_dh
    else:
        dst = DST + off_b.to(tl.int64) * stride_dp + i_tok.to(tl.int64) * stride_ds + off_h.to(tl.int64) * stride_dh
    o_d = tl.arange(0, BLOCK_D)
    rot_dims = 0
    if HAS_ROTARY:
        rot_dims = 2 * ROT_HALF
        rpos = base
        if HAS_LEFTPAD:
            rpos = rpos - tl.load(LEFTPAD + off_b)
        if PER_TOKEN_POS:
            rpos = rpos + i_tok
        rpos = tl.minimum(tl.maximum(rpos, 0), rot_rows - 1)  # checked on the host; memory-safe
        o_r = tl.arange(0, BLOCK_R)
        m_r = o_r < ROT_HALF
        if INTERLEAVED:
            i1 = 2 * o_r
            i2 = 2 * o_r + 1
        else:
            i1 = o_r
            i2 = o_r + ROT_HALF
        x1 = tl.load(src + i1, mask=m_r, other=0.0).to(tl.float32)
        x2 = tl.load(src + i2, mask=m_r, other=0.0).to(tl.float32)
        c = tl.load(COS + rpos.to(tl.int64) * stride_cos + o_r, mask=m_r, other=0.0).to(tl.float32)
        s = tl.load(SIN + rpos.to(tl.int64) * stride_cos + o_r, mask=m_r, other=0.0).to(tl.float32)
        tl.store(dst + i1, (x1 * c - x2 * s).to(DST.dtype.element_ty), mask=m_r)
        tl.store(dst + i2, (x1 * s + x2 * c).to(DST.dtype.element_ty), mask=m_r)
    m_pass = (o_d >= rot_dims) & (o_d < HEAD_DIM)
    x = tl.load(src + o_d, mask=m_pass, other=0.0)
    tl.store(dst + o_d, x.to(DST.dtype.element_ty), mask=m_pass)


@triton.jit
def _packed_span(SEQLENS_K, LEFTPAD, off_b, mask, capacity, HAS_LEFTPAD: tl.constexpr):
    """(first cache position, key count) of sequences ``off_b`` in the packed K/V: the keys
    [leftpad, min(seqlens_k, capacity)) that the attention kernel reads, clamped so that unchecked
    values (CUDA graph replay) never give a negative count or a start before the cache."""
    end = tl.minimum(tl.load(SEQLENS_K + off_b, mask=mask, other=0), capacity)
    start = end * 0
    if HAS_LEFTPAD:
        start = tl.maximum(tl.load(LEFTPAD + off_b, mask=mask, other=0), 0)
    return start, tl.maximum(end - start, 0)


@triton.jit
def _pack_offsets_kernel(SEQLENS_K, LEFTPAD, CU_K, batch, capacity,
                         HAS_LEFTPAD: tl.constexpr, BLOCK_B: tl.constexpr):
    """CU_K [batch + 1] int32: exclusive prefix sums of the sequences' key counts, the packed
    K/V's cu_seqlens. One program, BLOCK_B sequences per step: the offsets never leave the device,
    so the call needs no host sync and CUDA graphs capture it."""
    tl.store(CU_K + tl.arange(0, 1), tl.zeros([1], tl.int32))
    carry = tl.zeros([], tl.int32)
    for b0 in range(0, batch, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)
        m_b = o_b < batch
        _, n = _packed_span(SEQLENS_K, LEFTPAD, o_b, m_b, capacity, HAS_LEFTPAD)
        tl.store(CU_K + 1 + o_b, carry + tl.cumsum(n, 0), mask=m_b)
        carry += tl.sum(n, 0)


@triton.jit
def _gather_kv_kernel(K, V, K_OUT, V_OUT, SEQLENS_K, LEFTPAD, BT, CACHE_IDX, CU_K,
                      stride_kp, stride_ks, stride_kh,
                      stride_vp, stride_vs, stride_vh,
                      stride_btb, page_size, n_pages, capacity, batch, n_heads_k,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                      PAGED: tl.constexpr, HAS_CACHE_IDX: tl.constexpr,
                      HAS_LEFTPAD: tl.constexpr):
    """Rows j in [i_r * BLOCK_R, (i_r + 1) * BLOCK_R) of sequence b's capacity, one KV head: key
    j < n_b (cache position leftpad_b + j, paged or contiguous) goes to packed row cu_k[b] + j of
    K_OUT / V_OUT [batch * capacity, h_k, d] (upcast to their dtype). Rows j >= n_b are zeroed at
    row cu_k[batch] + b * capacity - cu_k[b + 1] + j: the sequences' unused capacities, laid end
    to end, are exactly the rows past cu_k[batch], so every row is written once and none is left
    uninitialized (the sm90 kernel's TMA tiles read past a sequence's end and mask only the
    scores: NaN garbage in V there would survive the zero probabilities)."""
    i_r = tl.program_id(0)
    off_b = tl.program_id(1)
    off_h = tl.program_id(2)
    start, n = _packed_span(SEQLENS_K, LEFTPAD, off_b, True, capacity, HAS_LEFTPAD)
    cu_b = tl.load(CU_K + off_b).to(tl.int64)
    tail = tl.load(CU_K + batch).to(tl.int64) + off_b.to(tl.int64) * capacity - cu_b - n
    o_j = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_key = o_j < n
    row = tl.where(m_key, cu_b, tail) + o_j
    page, slot = _cache_slots(BT, CACHE_IDX, off_b, off_b.to(tl.int64) * stride_btb, start + o_j,
                              m_key, page_size, n_pages, PAGED, HAS_CACHE_IDX)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    m_load = m_key[:, None] & m_d[None, :]
    slot = slot.to(tl.int64)
    head = off_h.to(tl.int64)
    # [BLOCK_R, BLOCK_D]
    b_k = tl.load(K + (page * stride_kp + slot * stride_ks + head * stride_kh)[:, None]
                  + o_d[None, :], mask=m_load, other=0.0)
    b_v = tl.load(V + (page * stride_vp + slot * stride_vs + head * stride_vh)[:, None]
                  + o_d[None, :], mask=m_load, other=0.0)
    p_out = (row * n_heads_k + head)[:, None] * HEAD_DIM + o_d[None, :]
    m_out = (o_j < capacity)[:, None] & m_d[None, :]
    tl.store(K_OUT + p_out, b_k.to(K_OUT.dtype.element_ty), mask=m_out)
    tl.store(V_OUT + p_out, b_v.to(V_OUT.dtype.element_ty), mask=m_out)


COMBINE_SLOTS = 16  # partials merged per step by the combine kernels


def _attn_warps(block_m: int, block_d: int, extras: bool) -> int:
    # plain decode tiles (at most 16 rows, d <= 128, no softcap/ALiBi/RoPE) run best with 4
    # warps: more programs per SM, more loads in flight (benchmarks/tune_decode.py on the H200:
    # 64x4k page 16 went from 3.09 to 4.05 TB/s, page 1 from 2.16 to 4.04). Everything else keeps
    # 8 warps, as first chosen: 4 have not been measured there. (The spills once quoted against 4
    # warps came from compiles without the launcher's divisibility specialization; compiled as
    # the GPU runs them these tiles are spill-free with 4 warps too: dense/inspect.py)
    return 4 if block_m <= 16 and block_d <= 128 and not extras else 8


def _attn_stages(on_gpu: bool, block_m: int) -> int:
    # K/V tiles in flight per program (cp.async pipelining of the gathered loads): 4 measured
    # best over the decode cells with 4 warps and 64-key tiles, 3 for the 128 x 128 prefill tiles
    # (benchmarks/tune_decode.py)
    if not on_gpu:
        return 1
    return 4 if block_m <= 16 else 3 if block_m >= 128 else 2


def _worklist_stages(on_gpu: bool, block_m: int, fp8: bool, decode: bool = True,
                     page_size: int = 16) -> int:
    # the planned launch's bf16/fp16 decode tiles over pages of >= 16: 2 stages measured best
    # under CUDA graphs (results/tune/tune_decode_graph.json, H200: geomean over 1x32k, 16x8k,
    # 64x4k 3.13 vs 3.04 TB/s with 4; 64x4k 4.03 vs 3.98, 16x8k 3.54 vs 3.44); with the
    # page-table chain Triton gives 2 and 4 the same single K/V buffer, and 2 leaves more shared
    # memory for co-resident programs. Only plain decode over pages of 16 was swept this way (not
    # fp8, prefill, RoPE/softcap/masks): the rest keep ``_attn_stages``. Pages of 1 need the 4
    # stages: with 2, 64x4k ran at 3.36 TB/s against 4.11 through flash_attn_with_kvcache's 4
    # (results/decode_sm90dec0_nvidia-h200_2026-11-29.json)
    if on_gpu and block_m <= 16 and not fp8 and decode and page_size >= 16:
        return 2
    return _attn_stages(on_gpu, block_m)


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


# programs a flash_attn_with_kvcache decode launch aims at per SM: the split count whose grid
# came nearest one wave of about 4 programs per SM without passing it was the fastest of 0-64
# splits in each of 9 cells (bf16, d 128, 32 / 8 heads, graph replays; session 26,
# results/tune/tune_kvcache_splits{,2}_9af71c4_*): 16 x 8k 4 splits (512 programs) 3.69 TB/s
# against 3.49 for the old rule's 3 (two per SM, rounded up), 12 x 8k 5 (480) 3.49 against 2.79
# (and 2.65 at 6 = 576), 8 x 8k 8 3.25 / 2.83, 4 x 8k 16 2.59 / 2.20, 2 x 8k 32 1.95 / 1.77,
# 1 x 32k 64 2.46 / 2.23, 16 x 4k 4 3.22 / 3.07, 32 x 4k 2 and 64 x 4k 1 unchanged
KVCACHE_PROGRAMS_PER_SM = 4
# the sm90 decode kernel's claim counters (``sm90_decode.CLAIM``): next unit, claims made and
# 256 per-SM arrival counts, int32 (here so that the wrapper allocates them without Gluon)
CLAIM_WORDS = 2 + 256


def num_splits_for(batch: int, n_heads_k: int, m_blocks: int, max_keys: int, block_n: int,
                   device: torch.device) -> int:
    """Splits of the key range so that the grid fills, without passing, one wave of
    ``KVCACHE_PROGRAMS_PER_SM`` programs per SM, each split with at least 4 key tiles (at most
    64 splits). The 4 was measured on the H200 only (d=128, bf16, 32 / 8 heads); other GPUs and
    head dims, whose occupancy may differ, take it untimed."""
    sms = sm_count(device)
    programs = batch * n_heads_k * m_blocks
    by_sms = KVCACHE_PROGRAMS_PER_SM * sms // max(programs, 1)
    by_len = max(1, max_keys // (4 * block_n))
    return max(1, min(by_sms, by_len, 64))


def kvcache_launch(b: int, s_q: int, h: int, h_k: int, d: int, capacity: int, extras: bool,
                   num_splits: int, device: torch.device) -> tuple[int, int, int, int, int, int]:
    """``kvcache_attn``'s tiles and key split: (block_m, block_d, block_n, m_blocks, split_len,
    num_splits), num_splits 0 picking one (``num_splits_for``) and any count rounded to whole
    key tiles; extras: softcap or ALiBi."""
    block_m, block_d, block_n = paged_tiles(h // h_k, d, s_q, extras)
    m_blocks = cdiv(s_q * (h // h_k), block_m)
    if num_splits <= 0:
        num_splits = num_splits_for(b, h_k, m_blocks, capacity, block_n, device)
    split_len = cdiv(cdiv(capacity, num_splits), block_n) * block_n
    return block_m, block_d, block_n, m_blocks, split_len, cdiv(capacity, split_len)


def kvcache_attn(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                 seqlens_k: torch.Tensor, leftpad: Optional[torch.Tensor],
                 block_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],
                 alibi_slopes: Optional[torch.Tensor], softmax_scale: float, window_left: int,
                 window_right: int, softcap: float, num_splits: int,
                 out: torch.Tensor, lse: torch.Tensor) -> None:
    """Attention of q [b, s_q, h, d] over the cache into ``out`` (q's layout) and ``lse``
    [b, h, s_q] fp32. k_pages / v_pages: [pages, page_size, h_k, d] (paged, with block_table
    [b, pages per sequence] int32) or a contiguous cache [b_cache, s_cache, h_k, d] (one page per
    sequence, row cache_batch_idx[b] or b). seqlens_k [b] int32: keys per sequence (cache
    positions [leftpad, seqlens_k)). num_splits 0 picks one."""
    b, s_q, h, d = q.shape
    h_k = k_pages.shape[2]
    group = h // h_k
    page_size = k_pages.shape[1]
    paged = block_table is not None
    capacity = block_table.shape[1] * page_size if paged else page_size
    if capacity == 0:  # no key anywhere: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
        return
    block_m, block_d, block_n, m_blocks, split_len, num_splits = kvcache_launch(
        b, s_q, h, h_k, d, capacity, softcap > 0 or alibi_slopes is not None, num_splits, q.device)
    split = num_splits > 1
    if split:
        o_part = torch.empty(num_splits, b, s_q, h, d, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(num_splits, b, h, s_q, device=q.device, dtype=torch.float32)
    else:
        o_part, lse_part = out, lse
    dummy = seqlens_k
    launcher(_kvcache_attn_kernel)[(num_splits, m_blocks, b * h_k)](
        q, k_pages, v_pages, out, lse, o_part, lse_part, seqlens_k,
        leftpad if leftpad is not None else dummy, block_table if paged else dummy,
        cache_batch_idx if cache_batch_idx is not None else dummy,
        alibi_slopes if alibi_slopes is not None else dummy, dummy, dummy,
        q.stride(0), q.stride(1), q.stride(2),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        block_table.stride(0) if paged else 0,
        alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
        s_q, h_k, group, page_size, k_pages.shape[0], capacity, split_len, num_splits, b,
        softmax_scale * LOG2E, softmax_scale / softcap if softcap > 0 else 0.0, softcap * LOG2E,
        window_left, window_right, 1.0, 0.0, dummy, dummy,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        PAGED=paged, HAS_CACHE_IDX=cache_batch_idx is not None, HAS_LEFTPAD=leftpad is not None,
        HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None, SPLIT=split, WORKLIST=False, CSR=False,
        num_warps=_attn_warps(block_m, block_d, softcap > 0 or alibi_slopes is not None
                              or k_pages.element_size() == 1),
        num_stages=_attn_stages(q.is_cuda, block_m),
    )
    if split:
        launcher(_combine_kernel)[(b * s_q, h)](
            out, lse, o_part, lse_part, out.stride(0), out.stride(1), out.stride(2),
            s_q, h, num_splits, b, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=COMBINE_SLOTS,
            num_warps=4,
        )


def gather_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, seqlens_k: torch.Tensor,
              leftpad: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
              cache_batch_idx: Optional[torch.Tensor], k_out: torch.Tensor, v_out: torch.Tensor,
              cu_k: torch.Tensor, capacity: Optional[int] = None) -> None:
    """Each sequence's keys (cache positions [leftpad, seqlens_k)) copied out of the cache into
    packed varlen K/V for the dense kernels. Caches as ``kvcache_attn``. k_out / v_out: contiguous
    [b * capacity, h_k, d] (any dtype: the cache is converted) get the keys, zeros past the last
    key; cu_k int32 [b + 1] their cu_seqlens, computed on the device: no host sync, so CUDA graphs
    capture the call. capacity: the cache positions per sequence (a block-table row's, or a
    contiguous cache's), or fewer (keys past it are not copied)."""
    b = seqlens_k.shape[0]
    h_k, d = k_pages.shape[2], k_pages.shape[3]
    page_size = k_pages.shape[1]
    paged = block_table is not None
    full = block_table.shape[1] * page_size if paged else page_size
    capacity = full if capacity is None else min(capacity, full)
    dummy = seqlens_k
    launcher(_pack_offsets_kernel)[(1,)](
        seqlens_k, leftpad if leftpad is not None else dummy, cu_k, b, capacity,
        HAS_LEFTPAD=leftpad is not None, BLOCK_B=min(_pow2(b), 1024), num_warps=4)
    block_d = _pow2(d, 16)
    # 4096 elements per tile over 8 warps, 16 per thread: spill-free at every head dim (sm90
    # ptxas, ioattn.dense.inspect); chosen before those reports had the launcher's divisibility
    # hints (8192 over 4 warps then showed spills) and not tuned on the GPU
    block_r = max(1, 4096 // block_d)
    if k_out.numel():
        launcher(_gather_kv_kernel)[(cdiv(capacity, block_r), b, h_k)](
            k_pages, v_pages, k_out, v_out, seqlens_k, leftpad if leftpad is not None else dummy,
            block_table if paged else dummy,
            cache_batch_idx if cache_batch_idx is not None else dummy, cu_k,
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
            block_table.stride(0) if paged else 0, page_size, k_pages.shape[0], capacity, b, h_k,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_R=block_r, PAGED=paged,
            HAS_CACHE_IDX=cache_batch_idx is not None, HAS_LEFTPAD=leftpad is not None,
            num_warps=8,
        )


def rope_store(src: torch.Tensor, dst: torch.Tensor, pos_base: torch.Tensor,
               rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor],
               interleaved: bool, per_token_pos: bool, leftpad: Optional[torch.Tensor],
               block_table: Optional[torch.Tensor] = None,
               cache_batch_idx: Optional[torch.Tensor] = None, to_cache: bool = False) -> None:
    """dst <- rotary(src) token by token (a copy without rotary_cos). src [b, s, h, d]; dst the
    same layout, or a cache (to_cache: token t of sequence i at position pos_base[i] + t)."""
    b, s, h, d = src.shape
    if b * s * h == 0:
        return
    has_rot = rotary_cos is not None
    rot_half = rotary_cos.shape[1] if has_rot else 1
    paged = block_table is not None
    dummy = pos_base
    launcher(_rope_store_kernel)[(b * s, h)](
        src, dst, rotary_cos if has_rot else src, rotary_sin if has_rot else src, pos_base,
        leftpad if leftpad is not None else dummy, block_table if paged else dummy,
        cache_batch_idx if cache_batch_idx is not None else dummy,
        src.stride(0), src.stride(1), src.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2),
        rotary_cos.stride(0) if has_rot else 0, rotary_cos.shape[0] if has_rot else 1,
        block_table.stride(0) if paged else 0, s,
        dst.shape[1] if to_cache else 1, dst.shape[0],
        (block_table.shape[1] * dst.shape[1] if paged else dst.shape[1]) if to_cache else 0,
        HEAD_DIM=d, BLOCK_D=_pow2(d, 16), ROT_HALF=rot_half, BLOCK_R=_pow2(rot_half, 16),
        HAS_ROTARY=has_rot, INTERLEAVED=interleaved, PER_TOKEN_POS=per_token_pos,
        HAS_LEFTPAD=leftpad is not None, TO_CACHE=to_cache, PAGED=paged,
        HAS_CACHE_IDX=cache_batch_idx is not None, num_warps=1,
    )


def paged_attn(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, indices: torch.Tensor,
               seqlens_indptr: torch.Tensor, work: torch.Tensor, n_work: torch.Tensor,
               slot_start: Optional[torch.Tensor], max_items: int, row_blocks: int, block_m: int,
               o_part: torch.Tensor, lse_part: torch.Tensor, softmax_scale: float,
               window_left: int, window_right: int, softcap: float, out: torch.Tensor,
               lse: torch.Tensor, lse_base2: bool,
               rope: Optional[tuple[float, float]] = None,
               mask: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               decode: bool = False,
               counts: Optional[torch.Tensor] = None,
               columns: Optional[torch.Tensor] = None, pdl: Optional[bool] = None,
               claims: Optional[torch.Tensor] = None) -> None:
    """Planned attention (plan()/run()) of ragged q [total_q, h, d] over pages [pages, page_size,
    h_k, d] (strided views serve NHD and HND) through the CSR page table ``indices``.
    ``seqlens_indptr`` holds the per-request kv lengths, kv indptr and qo indptr ([batch],
    [batch + 1], [batch + 1]); ``work`` [max_items, 5] the items (``n_work`` of them live), each
    run for ``row_blocks`` consecutive row blocks of ``block_m`` rows (the plan's); ``slot_start`` [batch + 1] the split decode
    requests' partial slots (merged afterwards), or None when no item splits. out [total_q, h, d],
    lse [total_q, h]. rope=(rope_scale, rope_theta) rotates q and K inside the kernel (FlashInfer's
    ROPE_LLAMA; the cache keeps unrotated keys). mask=(packed bits uint8, byte offsets int32
    [batch + 1]) is FlashInfer's packed custom mask (True = attend). Launches a fixed grid, so CUDA graphs replay it under new plans; allocates
    nothing. decode: one query row per request (the decode wrapper); on Hopper such calls run
    the sm90 decode kernel where it covers them
    (``ioattn.decode.sm90_decode``), which reads work, n_work and seqlens_indptr before PDL's
    wait (``sm90_decode.EARLY``): with decode=True they must be written by copies (a kernel
    that writes them must not be the launch just before this one); columns [C + 1] (a balanced plan, ``split_work_balanced``)
    makes it run one CTA per column and KV head over the column's items (the portable kernel
    runs the items one a program either way); pdl: the sm90 decode kernel launched with
    programmatic dependent launch or not (None: ``sm90_decode.PDL``); claims
    [``CLAIM_WORDS``] int32 zeros (a grid larger than the work: a graph's bound):
    the sm90 decode kernel's CTAs claim their work SM by SM (``sm90_decode.CLAIM``; n_work must
    then be written by copies, never by a kernel)."""
    total_q, h, d = q.shape
    b = slot_start.shape[0] - 1 if slot_start is not None else (seqlens_indptr.shape[0] - 2) // 3
    h_k = k_pages.shape[2]
    group = h // h_k
    block_d = _pow2(d, 16)
    extras = softcap > 0 or rope is not None or mask is not None or window_right >= 0
    # (softcap runs in the sm90 kernel too; RoPE, masks and windows do not)
    if decode and _sm90_decode(q, k_pages, v_pages, rope is not None
                                             or mask is not None or window_right >= 0
                                             or window_left >= 0):
        from ioattn.decode.sm90_decode import paged_decode_sm90

        # split requests merged inside the kernel (SM90_DECODE_MERGE): no combine launch
        merge = (counts, slot_start) if SM90_DECODE_MERGE and counts is not None \
            and slot_start is not None else None
        paged_decode_sm90(q, k_pages, v_pages, indices, seqlens_indptr, work, n_work, max_items,
                          o_part, lse_part, softmax_scale, out, lse, lse_base2, merge, columns,
                          softcap, pdl, claims)
        if merge is not None:
            return
    else:
        block_n, warps = worklist_launch(block_m, block_d, k_pages.element_size() == 1,
                                         softcap > 0 or rope is not None)
        launcher(_kvcache_attn_kernel)[(max_items, row_blocks, h_k)](
            q, k_pages, v_pages, out, lse, o_part, lse_part, seqlens_indptr, seqlens_indptr, indices,
            seqlens_indptr, seqlens_indptr, work, n_work,
            0, q.stride(0), q.stride(1),
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
            0, out.stride(0), out.stride(1),
            0, 0,
            1, h_k, group, k_pages.shape[1], k_pages.shape[0], indices.shape[0] * k_pages.shape[1], 0, 0, b,
            softmax_scale * LOG2E, softmax_scale / softcap if softcap > 0 else 0.0, softcap * LOG2E,
            window_left, window_right, 1.0 / rope[0] if rope else 1.0, math.log2(rope[1]) if rope else 0.0,
            mask[0] if mask is not None else seqlens_indptr, mask[1] if mask is not None else seqlens_indptr,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
            PAGED=True, HAS_CACHE_IDX=False, HAS_LEFTPAD=False,
            HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_SOFTCAP=softcap > 0,
            HAS_ALIBI=False, SPLIT=False, WORKLIST=True, CSR=True, LSE_BASE2=lse_base2,
            ROPE=rope is not None, BLOCK_HD=_pow2(d // 2, 16), HAS_MASK=mask is not None,
            num_warps=warps, num_stages=_worklist_stages(q.is_cuda, block_m, k_pages.element_size() == 1,
                                                         decode and not extras, k_pages.shape[1]),
        )
    if slot_start is not None:
        launcher(_combine_slots_kernel)[(b, h)](
            out, lse, o_part, lse_part, slot_start, out.stride(0), out.stride(1), h,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=COMBINE_SLOTS, LSE_BASE2=lse_base2, num_warps=4,
        )


# the planned decode on the sm90 Gluon kernel (``_sm90_decode``), on by default: on the H200 it
# ran 1.2x the portable kernel at 1 x 32k under CUDA-graph replay (2.58 vs 2.16 TB/s; 35.7 vs
# 52.6 us in the kernel) and level or ahead at 16 x 8k, 64 x 4k and 128 x 2k
# (results/decode_sm90dec{1,0}_*.json); IOATTN_SM90_DECODE=0 turns it off. Read at import, as
# the other switches
SM90_DECODE = os.environ.get("IOATTN_SM90_DECODE", "1").lower() not in ("0", "false", "off")
# the sm90 decode kernel merges split requests itself (``sm90_decode._merge_parts``: the last
# item of a request, by an atomic ticket) instead of a combine launch: on by default since it
# measured 1.01-1.02x under graph replay on the H200 (2.68 vs 2.62 TB/s at 1 x 32k, 3.69 vs
# 3.64 at 16 x 8k, 4.17 vs 4.12 at 64 x 4k; results/decode_merge{1,0}_*.json);
# IOATTN_SM90_DECODE_MERGE=0 turns it off
SM90_DECODE_MERGE = os.environ.get("IOATTN_SM90_DECODE_MERGE", "1").lower() not in ("0", "false", "off")
# FlashInfer's balanced split for planned decode (``ioattn.paged.plan.split_work_balanced``): the
# key tiles cut into equal runs, one sm90 CTA per run and KV head, all resident at once, each
# looping over its run's pieces. Today's split gives 64 x 4k 512 equal CTAs on 264 slots (1.94
# waves: the second leaves 16 slots idle) and 16 x 8k 384 (1.45 waves, 0.90x cuDNN);
# IOATTN_SM90_DECODE_BALANCED=1 turns it on (opt-in until measured on the H200)
SM90_DECODE_BALANCED = os.environ.get("IOATTN_SM90_DECODE_BALANCED", "0").lower() in ("1", "true", "on")


# Eager plans of every size run the sm90 kernel where it covers them. Until session 33, plans
# under 200 MiB of K+V kept the portable kernel (IOATTN_SM90_DECODE_MIN_BYTES): the sm90
# launch's host time (~200 us a run() on the H100 machine) outweighed its faster kernel there.
# With its launches kept for repeats (``sm90_decode._BOUND``) run() costs 79 us, and the eager
# 1 x 32k cell reads 2.12 TB/s on the sm90 kernel against 1.20 on the portable one (cuDNN
# 2.13; 16 x 8k and 64 x 4k level), on an H100
# (results/tune/decode_eager_{sm90,portable}_e287008_nvidia-h100_*)


def _sm90_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                 extras: bool) -> bool:
    """Whether a planned decode call runs the sm90 decode kernel: on Hopper (``SM90_DECODE``)
    where ``sm90_decode.unsupported_reason`` has nothing against it."""
    if not SM90_DECODE or not q.is_cuda or sm90_unavailable_reason(q.device) is not None:
        return False  # (before the import: the module loads Gluon, which a GPU may lack)
    from ioattn.decode import sm90_decode

    # (answered once per form of the call: what coverage_problem reads, alignment included)
    key = (q.device, q.dtype, q.shape[1:], k_pages.dtype, k_pages.shape[1:], k_pages.stride(),
           k_pages.data_ptr() % 16, v_pages.dtype, v_pages.shape[1:], v_pages.stride(),
           v_pages.data_ptr() % 16, extras, sm90_decode.FP8, sm90_decode.SUPPORTED_HEAD_DIMS)
    got = _COVERED.get(key)
    if got is None:
        got = keep(_COVERED, key, sm90_decode.coverage_problem(q, k_pages, v_pages, 1, extras)
                   is None)
    return got


_COVERED: dict = {}  # ``_sm90_decode``'s answers by the call's form


def paged_tiles(group: int, d: int, rows_per_request: int = 1,
                extras: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, BLOCK_N) of the paged kernels: rows = query tokens x GQA group.
    ``extras``: softcap, ALiBi or RoPE in the kernel (their tall tiles have not been measured)."""
    block_d = _pow2(d, 16)
    rows = _pow2(rows_per_request * group, 16)
    if rows >= 128 and block_d <= 128 and not extras:
        # chunked prefill: 128-row tiles of 64 keys, 8 warps, 3 stages (results/tune/
        # tune_prefill.json on the H200: 8 x (4k + 512) went from 140 to 229 TFLOP/s; 128 keys
        # gave 242, within the noise, with 2.7x the spills)
        return 128, block_d, 64
    block_m = min(rows, 64 if block_d <= 128 else 32)
    return block_m, block_d, _tile_n(block_m, block_d)


def worklist_launch(block_m: int, block_d: int, fp8: bool, extras: bool) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the planned (FlashInfer wrappers') attention launch. An fp8 cache's
    plain decode tiles take 4 warps over 128-key tiles: measured best on the H200
    (results/tune/tune_decode_fp8_f16.json: 1.50 -> 1.81 TB/s of fp8 bytes at 64x4k, 2.22 with
    pages of 1); other fp8 tiles keep 8 warps (the 128-row prefill tile spills 312 B with 4)."""
    if fp8 and block_m <= 16 and block_d <= 128 and not extras:
        return 128, 4
    return _tile_n(block_m, block_d), _attn_warps(block_m, block_d, extras or fp8)


def _tile_n(block_m: int, block_d: int) -> int:
    # first chosen from sm90 compiles without the launcher's divisibility specialization, which
    # overstated spills (64-key tiles at 64 rows; d=256 at 16-key tiles and at most 32 rows, RoPE's
    # rotated halves included); the H200 sweeps since (tune_decode.py) covered the decode tiles
    if block_d > 128:
        return 16
    if block_m >= 128:
        return 64
    return 64 if block_m < 64 else 32

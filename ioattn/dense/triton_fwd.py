"""Portable Triton forward kernel (online softmax in exp2, fp32 accumulation) and its launcher.

One kernel serves the batched ([b, s, h, d]) and varlen ([total, h, d] + cu_seqlens) layouts:
a batched call is the varlen case with equal lengths, handled through batch strides.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ioattn.dense import configs
from ioattn.dense.common import (LOG2E, cdiv, dropout_keep, ensure_tma_allocator, kv_block_range,
                                 kv_sources, load_kv_block, scores_log2, seq_bounds,
                                 tma_compatible, visible)
from ioattn.dense.params import AttnParams
from ioattn.launch import launcher, repeat

# (fp8) the probabilities P are multiplied by 2^FP8_P_SHIFT before their fp8 conversion (they are
# <= 1, and e4m3 keeps ~3 significant bits down to 2^-6, subnormals to 2^-9): P then spans
# e4m3's range up to 256 (< 448), as FlashAttention-3 does; the row sums carry the same factor,
# so O is unchanged and the LSE subtracts it.
FP8_P_SHIFT = tl.constexpr(8.0)
# (fp8) the sequence rows that share one descale in block quantization (ioattn.fp8.quantize):
# the kernels' query and key blocks divide it, so each block reads one descale
FP8_BLOCK = 128


@triton.jit
def _live_descale(d):
    """(fp8) A score descale (Q's times K's) of 0 as 1e-30: the scores it scales are 0 either
    way, but masked ones stay -inf (-inf x 0 is NaN)."""
    return tl.where(d == 0.0, 1e-30, d)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn,
               start, end, offs_m, offs_n, offs_d, offs_dv, seqlen_k, off,
               window_left, window_right, qk_scale_log2, softcap_scale, softcap_log2, slope_log2,
               seed, rng_row0, max_seqlen_k, dropout_p,
               q_descale, kd_base, stride_kdk, vd_base, stride_vdk, v_descale,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, EVEN_D: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
               WARP_SPEC: tl.constexpr, FP8: tl.constexpr, KD_BLOCKED: tl.constexpr,
               VD_BLOCKED: tl.constexpr, FP8_BLOCK: tl.constexpr, V_T: tl.constexpr):
    # k_src / v_src: from kv_sources (TMA descriptors or pointer blocks)
    WS: tl.constexpr = WARP_SPEC and not MASKED
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        if V_T:  # every non-empty range starts at a multiple of BLOCK_N (kv_block_range);
            # written so the compiler sees it (tl.multiple_of on the bounds does not reach the
            # loop), the V tile's loads, contiguous along the keys, go 16 bytes at a time through
            # cp.async instead of byte by byte in the loop (session 42: the d=256 fp8 forward's
            # V was 64 LDG.U8 a thread an iteration, unpipelined)
            start_n = (start_n // BLOCK_N) * BLOCK_N
        cols = start_n + offs_n
        # [BLOCK_N, BLOCK_D]
        k = load_kv_block(k_src, start_n, stride_kn, cols, offs_d, seqlen_k, HEAD_DIM, MASKED, EVEN_D,
                          USE_TMA)
        # [BLOCK_M, BLOCK_N]
        qk = tl.dot(q, tl.trans(k))
        scale_log2 = qk_scale_log2
        cap_scale = softcap_scale
        if KD_BLOCKED:  # (fp8) K's descale of this key block's quantization block, times Q's
            kd = _live_descale(q_descale * tl.load(kd_base + (start_n // FP8_BLOCK) * stride_kdk))
            scale_log2 = scale_log2 * kd
            cap_scale = cap_scale * kd
        s, _, c = scores_log2(qk, offs_m[:, None], cols[None, :], off, scale_log2, cap_scale,
                              softcap_log2, slope_log2, HAS_SOFTCAP, HAS_ALIBI)
        if MASKED:
            s = tl.where(visible(offs_m[:, None], cols[None, :], seqlen_k, off, window_left, window_right,
                                 HAS_LEFT, HAS_RIGHT), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * c)
            # a row with nothing visible yet keeps m = -inf; shift by 0 so exp2 sees -inf, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * c)
            m_use = m_new
        if FP8:  # P scaled by 2^8 (cancels in l) so that fp8's range keeps small probabilities
            p = tl.exp2(s * c - (m_use - FP8_P_SHIFT)[:, None])
        else:
            p = tl.exp2(s * c - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if VD_BLOCKED:  # (fp8) V's descale varies by key block: acc holds O over the current
            # block's descale (v_descale), rescaled with alpha as the block changes, so P stays
            # as it is (rounded as without descales) and O takes the last one at the end. A
            # descale of 0 zeroes the block's values (its keys still count in l).
            vd = tl.load(vd_base + (start_n // FP8_BLOCK) * stride_vdk)
            live = vd > 0
            acc = acc * (alpha * tl.where(live, v_descale / tl.where(live, vd, 1.0), 1.0))[:, None]
            v_descale = tl.where(live, vd, v_descale)
            p = p * live.to(tl.float32)
        else:
            acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_row0, offs_m[:, None], cols[None, :], max_seqlen_k, dropout_p)
            p = tl.where(keep, p, 0.0)
        v = load_kv_block(v_src, start_n, stride_vn, cols, offs_dv, seqlen_k, HEAD_DIM_V, MASKED,
                          EVEN_D, USE_TMA, V_T)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i, v_descale


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, SLOPES, CU_Q, CU_K, RNG,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_sb,
    n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed, rng_rows, max_seqlen_k,
    qk_scale_log2, softcap_scale, softcap_log2, window_left, window_right, dropout_p,
    QD, KD, VD, stride_qdb, stride_qdh, stride_qdk, stride_kdb, stride_kdh, stride_kdk,
    stride_vdb, stride_vdh, stride_vdk, qd_group, stride_vd,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, FP8: tl.constexpr = False,
    KD_BLOCKED: tl.constexpr = False, VD_BLOCKED: tl.constexpr = False,
    FP8_BLOCK: tl.constexpr = 128, V_T: tl.constexpr = False,
):
    # FP8: q, k, v in fp8 (e4m3), O in bf16. Descales QD / KD / VD (fp32, x = x_fp8 * descale)
    # indexed [batch, head, block of FP8_BLOCK rows of the sequence] through their strides: a
    # per-head descale has a block stride of 0. Q's head index is off_h // qd_group (per query
    # head: 1; per KV head, FlashAttention-3's form: the GQA group). KD_BLOCKED / VD_BLOCKED: K's
    # / V's descale varies along the keys (block quantization), read per key block; otherwise it
    # is one number for the program, folded into the scales (K) or applied to O at the end (V).
    # V_T: V's keys are contiguous (stride_vn 1; its head dim's stride is stride_vd), the
    # layout the fp8 P·V wgmma reads without a transpose (``ioattn.fp8.keys_contiguous``).
    EVEN_D: tl.constexpr = (BLOCK_D == HEAD_DIM) and (BLOCK_DV == HEAD_DIM_V)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads
    off_h = pid_bh % n_heads
    off_hk = off_h // kv_group
    q_start, seqlen_q, k_start, seqlen_k, rng_q0 = seq_bounds(CU_Q, CU_K, off_b, seqlen_q_fixed,
                                                              seqlen_k_fixed, IS_VARLEN)
    # heaviest query blocks first (the last ones under a causal mask) shortens the tail
    start_m = (tl.num_programs(0) - 1 - pid_m) * BLOCK_M
    if start_m >= seqlen_q:
        return

    off_b64 = off_b.to(tl.int64)
    q_base = Q + off_b64 * stride_qb + q_start.to(tl.int64) * stride_qm + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b64 * stride_kb + k_start.to(tl.int64) * stride_kn + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b64 * stride_vb + k_start.to(tl.int64) * stride_vn + off_hk.to(tl.int64) * stride_vh
    o_base = O + off_b64 * stride_ob + q_start.to(tl.int64) * stride_om + off_h.to(tl.int64) * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    # [BLOCK_M, BLOCK_D]
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if V_T:  # (the V tiles' loads take the head dim's stride)
        stride_vn = stride_vd
    k_src, v_src = kv_sources(k_base, v_base, seqlen_k, stride_kn, stride_vn, offs_n, offs_d, offs_dv,
                              HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, V_T)

    q_descale = 1.0
    v_descale = 1.0
    kd_base = KD
    vd_base = VD
    if FP8:
        q_descale = tl.load(QD + off_b64 * stride_qdb + (off_h // qd_group) * stride_qdh
                            + (start_m // FP8_BLOCK) * stride_qdk)
        kd_base = KD + off_b64 * stride_kdb + off_hk * stride_kdh
        vd_base = VD + off_b64 * stride_vdb + off_hk * stride_vdh
        if not KD_BLOCKED:
            kd = _live_descale(q_descale * tl.load(kd_base))
            qk_scale_log2 = qk_scale_log2 * kd
            softcap_scale = softcap_scale * kd
        if not VD_BLOCKED:  # (blocked: the current key block's, carried by _fwd_inner)
            v_descale = tl.load(vd_base)
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(SLOPES + off_b * stride_sb + off_h).to(tl.float32) * 1.4426950408889634
    seed = 0
    rng_row0 = 0
    if HAS_DROPOUT:
        seed = tl.load(RNG)
        rng_row0 = (off_h.to(tl.int64) * rng_rows + rng_q0) + tl.load(RNG + 1)

    off = seqlen_k - seqlen_q
    lo, full_lo, full_hi, hi = kv_block_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                              BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # masked edge blocks, then the unmasked interior, then the masked tail (diagonal, seqlen_k cut)
    acc, l_i, m_i, v_descale = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn,
                               lo, full_lo, offs_m, offs_n, offs_d, offs_dv, seqlen_k, off,
                               window_left, window_right, qk_scale_log2, softcap_scale, softcap_log2,
                               slope_log2, seed, rng_row0, max_seqlen_k, dropout_p,
                               q_descale, kd_base, stride_kdk, vd_base, stride_vdk, v_descale,
                               HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, EVEN_D,
                               HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                               USE_TMA, WARP_SPEC, FP8, KD_BLOCKED, VD_BLOCKED, FP8_BLOCK, V_T)
    acc, l_i, m_i, v_descale = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn,
                               full_lo, full_hi, offs_m, offs_n, offs_d, offs_dv, seqlen_k, off,
                               window_left, window_right, qk_scale_log2, softcap_scale, softcap_log2,
                               slope_log2, seed, rng_row0, max_seqlen_k, dropout_p,
                               q_descale, kd_base, stride_kdk, vd_base, stride_vdk, v_descale,
                               HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, EVEN_D,
                               HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                               USE_TMA, WARP_SPEC, FP8, KD_BLOCKED, VD_BLOCKED, FP8_BLOCK, V_T)
    acc, l_i, m_i, v_descale = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn,
                               full_hi, hi, offs_m, offs_n, offs_d, offs_dv, seqlen_k, off,
                               window_left, window_right, qk_scale_log2, softcap_scale, softcap_log2,
                               slope_log2, seed, rng_row0, max_seqlen_k, dropout_p,
                               q_descale, kd_base, stride_kdk, vd_base, stride_vdk, v_descale,
                               HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, EVEN_D,
                               HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                               USE_TMA, WARP_SPEC, FP8, KD_BLOCKED, VD_BLOCKED, FP8_BLOCK, V_T)

    # rows that saw no key: l = 0 -> out 0, LSE -inf
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    lse_log2 = m_i + tl.log2(tl.where(empty, 1.0, l_i))
    if FP8:
        inv_l = inv_l * v_descale
        lse_log2 = lse_log2 - FP8_P_SHIFT  # (l summed P scaled by 2^FP8_P_SHIFT)
    acc = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), lse_log2 * 0.6931471805599453)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_dv[None, :], acc.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    lse_ptrs = LSE + off_b64 * stride_lb + off_h.to(tl.int64) * stride_lh + q_start + offs_m
    tl.store(lse_ptrs, lse, mask=row_ok)


def keys_contiguous_layout(v: torch.Tensor) -> bool:
    """Whether V's keys are its contiguous dim ([b, s, h, d] or [total, h, d] with stride 1 over
    s): the fp8 forward's V_T layout (``ioattn.fp8.keys_contiguous`` makes it)."""
    return v.stride(-3) == 1 and v.stride(-1) != 1 and v.shape[-3] > 1


def _descale_args(p: AttnParams, q: torch.Tensor, cfg) -> tuple:
    """The kernel's QD, KD, VD pointers, their (batch, head, block) strides and qd_group: q
    itself and zeros where the call is not fp8 (never read)."""
    if not p.fp8:
        return (q, q, q) + (0,) * 9 + (1,)
    if FP8_BLOCK % cfg.block_m or FP8_BLOCK % cfg.block_n:  # (every config's blocks divide it)
        raise RuntimeError(f"fp8 block descales need tiles dividing {FP8_BLOCK} rows, the config "
                           f"has {cfg.block_m} x {cfg.block_n}")
    ds = (p.q_descale, p.k_descale, p.v_descale)
    return (*ds, *(st for t in ds for st in t.stride()),
            q.shape[-2] // p.q_descale.shape[1])


# (``attn_fwd``'s ``key``) launches kept for repeats of a call's form, by the caller's key
_BOUND: dict = {}


def attn_fwd(p: AttnParams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, key=None) -> None:
    """Launch the forward into preallocated ``out`` (q's layout, d_v) and ``lse`` (fp32).

    ``key`` (the op's ``BIND``; for params that hold no tensor): everything this launch's
    arguments derive from but the addresses of q, k, v, out and lse (shapes, strides, dtypes,
    device, the params' scalars and each pointer's 16-byte alignment). The first launch under a
    key (and config table, ``configs.fwd_config``) is kept (``launch.Bound``); a repeat is one
    C call with this call's five addresses, past the config, the argument list and the
    launcher's per-call signature. The pointer arguments that stand in for absent ALiBi
    slopes, cu_seqlens and RNG state keep the first call's q address (never read: their
    flags are off)."""
    if key is not None:  # (the config table too: tuning swaps it between calls of one form)
        key = (key, configs.fwd_config)
        if key in _BOUND and repeat(_BOUND, key, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                    out.data_ptr(), lse.data_ptr()):
            return
    cfg = configs.fwd_config(q.device, p.head_dim, p.head_dim_v, q.dtype, p.causal_like,
                             p.max_seqlen_q)
    n_heads = q.shape[-2]
    grid = (cdiv(p.max_seqlen_q, cfg.block_m), p.batch * n_heads)
    if grid[0] * grid[1] == 0:
        return
    sb = p.batch_strides
    # ptxas (Triton 3.6's) crashes on the TMA variant at head dim 256 with num_stages >= 2 (also
    # reproduced on CPU: python -m ioattn.dense.inspect); warp specialization needs 8 warps
    v_t = p.fp8 and keys_contiguous_layout(v)
    if v_t and v.stride(-1) * v.shape[-1] >= 2**31:  # (the kernel indexes d x its stride in int32)
        raise ValueError(f"v: its keys-innermost layout spans {v.stride(-1)} x {v.shape[-1]} >= "
                         f"2^31 elements per head; pass v as [.., heads, headdim] rows "
                         f"(v.contiguous()) or fewer keys per call")
    use_tma = cfg.tma and max(p.head_dim, p.head_dim_v) <= 128 and (
        tma_compatible(q, k, v) if not v_t else
        tma_compatible(q, k) and not p.is_varlen and v.data_ptr() % 16 == 0
        and all(st % 16 == 0 for st in (v.stride(0), v.stride(-2), v.stride(-1))))
    if use_tma:
        ensure_tma_allocator()
    args = (
        q, k, v, out, lse, p.alibi_arg(q), p.cu_q_arg(q), p.cu_k_arg(q), p.rng_arg(q),
        sb(q), q.stride(-3), q.stride(-2),
        sb(k), k.stride(-3), k.stride(-2),
        sb(v), v.stride(-3), v.stride(-2),
        sb(out), out.stride(-3), out.stride(-2),
        *p.lse_strides(lse), p.alibi_batch_stride,
        n_heads, n_heads // k.shape[-2], p.max_seqlen_q, p.max_seqlen_k, p.rng_rows, p.max_seqlen_k,
        p.softmax_scale * LOG2E, p.softmax_scale / p.softcap if p.softcap > 0 else 0.0,
        p.softcap * LOG2E, p.window_left, p.window_right, p.dropout_p,
        *_descale_args(p, q, cfg), v.stride(-1))
    kwargs = dict(
        HEAD_DIM=p.head_dim, HEAD_DIM_V=p.head_dim_v,
        BLOCK_D=configs.pad_dim(p.head_dim), BLOCK_DV=configs.pad_dim(p.head_dim_v),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        IS_VARLEN=p.is_varlen, HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0,
        HAS_SOFTCAP=p.softcap > 0, HAS_ALIBI=p.alibi_slopes is not None, HAS_DROPOUT=p.dropout_p > 0,
        USE_TMA=use_tma, WARP_SPEC=use_tma and cfg.warp_specialize and cfg.num_warps == 8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if p.fp8:
        kwargs.update(FP8=True, KD_BLOCKED=p.k_descale.stride(2) != 0,
                      VD_BLOCKED=p.v_descale.stride(2) != 0, FP8_BLOCK=FP8_BLOCK, V_T=v_t)
    lch = launcher(_attn_fwd_kernel)
    if key is None or use_tma:  # (device-side TMA takes scratch memory: never bound)
        lch[grid](*args, **kwargs)
    else:  # (slots: q, k, v, out, lse)
        lch.bind_kept(_BOUND, key, grid, args, kwargs, (0, 1, 2, 3, 4))


@triton.jit
def _dropout_mask_kernel(MASK, CU_Q, RNG, n_heads, rng_rows, max_seqlen_q, max_seqlen_k,
                         dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         IS_VARLEN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads
    off_h = pid_bh % n_heads
    if IS_VARLEN:
        rng_q0 = tl.load(CU_Q + off_b)
    else:
        rng_q0 = off_b * max_seqlen_q
    seed = tl.load(RNG)
    rng_row0 = off_h.to(tl.int64) * rng_rows + rng_q0 + tl.load(RNG + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    base = MASK + pid_bh.to(tl.int64) * max_seqlen_q * max_seqlen_k
    for start_n in range(0, max_seqlen_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed, rng_row0, offs_m[:, None], offs_n[None, :], max_seqlen_k, dropout_p)
        tl.store(base + offs_m[:, None] * max_seqlen_k + offs_n[None, :], keep.to(tl.int8),
                 mask=(offs_m[:, None] < max_seqlen_q) & (offs_n[None, :] < max_seqlen_k))


def dropout_keep_mask(p: AttnParams, n_heads: int, device: torch.device) -> torch.Tensor:
    """The forward's dropout keep-mask as bool [batch, heads, max_seqlen_q, max_seqlen_k] (for tests:
    varlen sequences occupy the top-left [s_q_i, s_k_i] corner of their slice)."""
    mask = torch.empty(p.batch, n_heads, p.max_seqlen_q, p.max_seqlen_k, dtype=torch.int8, device=device)
    grid = (cdiv(p.max_seqlen_q, 32), p.batch * n_heads)
    _dropout_mask_kernel[grid](mask, p.cu_q_arg(mask), p.rng_state, n_heads, p.rng_rows, p.max_seqlen_q,
                               p.max_seqlen_k, p.dropout_p, BLOCK_M=32, BLOCK_N=32,
                               IS_VARLEN=p.is_varlen)
    return mask.bool()

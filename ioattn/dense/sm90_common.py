"""Pieces shared by the sm90 Gluon kernels (``sm90_fwd``, ``sm90_bwd``): sequence bounds, tile
ranges under causal/window masks, and the host-side TMA views.

Layout convention: q, k, v, out (and their gradients) are read as row-major [rows, heads * d]
matrices through host TMA descriptors; batched [b, s, h, d] tensors are the varlen case with equal
lengths (rows = b * s). Masks follow ``common.py``: bottom-right aligned, ``off = seqlen_k -
seqlen_q``, query row i sees key j iff i + off - left <= j <= i + off + right.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma)
from triton.language.core import builtin

from ioattn.dense.common import LOG2E
from ioattn.launch import Desc

# tensor dtypes the TMA descriptors lay out (fp32: the fused backward's dQ accumulator; fp8: the
# decode kernel's cache tiles, converted to fp16 operands in shared memory)
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
             torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}
OPERAND_DTYPES = (torch.bfloat16, torch.float16)  # what the kernels' wgmma operands take


@builtin
def tma_reduce_add(desc, offsets, src, _semantic=None):
    """desc[offsets] += src, a shared-memory tile, through an asynchronous TMA reduction
    (``cp.reduce.async.bulk.tensor ... add``): Gluon 3.6 has no wrapper for it, but its builder
    makes the op. Like a TMA store, ``tma.store_wait`` tells when ``src`` may be written again."""
    offs = _semantic._convert_to_ir_values(offsets, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, offs,
                                              src.handle)


@gluon.constexpr_function
def heads_view(block_shape) -> bool:
    """Whether a descriptor's box is [rows, 1, cols] over a [rows, heads, d] view (a zero-padded
    head dim, ``rows_descriptor(pad_to=...)``) rather than [rows, cols] over [rows, heads * d]."""
    return len(block_shape) == 3


@gluon.constexpr_function
def box_cols(block_shape) -> int:
    """A descriptor box's columns (its last dim): the kernels' head dim, padded or not."""
    return block_shape[-1]


@gluon.constexpr_function
def nvmma_at_rank(layout, rank):
    """``layout``'s swizzle at another rank: a [rows, cols] tile and a [rows, 1, cols] box lay
    their bytes out alike (kernels: ``tile_layout``; the host: ``shared_layout_3d``)."""
    if layout.rank == rank:
        return layout
    return gl.NVMMASharedLayout(swizzle_byte_width=layout.swizzle_byte_width,
                                element_bitwidth=layout.element_bitwidth, rank=rank,
                                transposed=layout.transposed)


@gluon.constexpr_function
def tile_layout(layout):
    """The [rows, cols] shared layout of a descriptor's tiles (its own, at rank 2)."""
    return nvmma_at_rank(layout, 2)


@gluon.constexpr_function
def _whole(shape, alloc_shape) -> bool:
    """Whether a shared-memory view covers its allocation's trailing dims (an ``index`` of a
    buffer, not a row slice: a reinterpreted slice would be taken as contiguous)."""
    return list(shape) == list(alloc_shape)[len(alloc_shape) - len(shape):]


@gluon.jit
def _heads_box(desc, smem):
    """``smem`` as the [rows, 1, cols] box of a [rows, heads, d] view's descriptor (its bytes
    laid out as the [rows, cols] tile's); a whole buffer or an index of one, never a row slice."""
    gl.static_assert(_whole(smem.shape, smem.type.alloc_shape),
                     "a 3D box lands in a whole buffer (or an index of one), not a slice")
    return smem._reinterpret(smem.dtype, [smem.shape[0], 1, desc.block_type.shape[2]],
                             desc.layout)


@gluon.jit
def tma_load(desc, row, col, bar, smem, pred=True):
    """TMA copy of the box at (row, col) of ``desc``'s [rows, heads * d] view into ``smem``; col is
    a head's first column, head * cols. Over a [rows, heads, d] view (``heads_view``), the box
    of head col // cols, its columns past d zero-filled by the TMA unit."""
    if heads_view(desc.block_type.shape):
        tma.async_copy_global_to_shared(desc, [row, col // desc.block_type.shape[2], 0], bar,
                                        _heads_box(desc, smem), pred=pred)
    else:
        tma.async_copy_global_to_shared(desc, [row, col], bar, smem, pred=pred)


@gluon.jit
def tma_store(desc, row, col, smem):
    """TMA store of ``smem`` to the box at (row, col) (as ``tma_load``); over a [rows, heads, d]
    view, columns past d are clipped by the TMA unit."""
    if heads_view(desc.block_type.shape):
        tma.async_copy_shared_to_global(desc, [row, col // desc.block_type.shape[2], 0],
                                        _heads_box(desc, smem))
    else:
        tma.async_copy_shared_to_global(desc, [row, col], smem)


@gluon.jit
def stage_tma_store(desc, row, col, smem, x):
    """An output tile from registers through ``smem`` (a free buffer of the desc's box) to the
    box at (row, col) by TMA; ``tma.store_wait`` tells when smem may be written again."""
    smem.store(x)
    fence_async_shared()
    tma_store(desc, row, col, smem)


@gluon.jit
def store_cols(ptrs, x, rows_ok, cols, N: gl.constexpr):
    """Masked stores of an output or gradient tile from registers: rows where rows_ok, and
    columns < N where the tile is zero-padded past its tensor's head dim N (0: every column)."""
    if N:
        gl.store(ptrs, x, mask=rows_ok & (cols < N)[None, :])
    else:
        gl.store(ptrs, x, mask=rows_ok)


@gluon.constexpr_function
def wgmma_acc_layout(n, bits=16):
    """Accumulator layout of one consumer warpgroup's wgmma: 64 rows (4 warps) by ``n`` columns,
    on ``bits``-bit operands (the instruction's K: 16 for fp16/bf16, 32 for fp8)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, n, 256 // bits])


@gluon.constexpr_function
def wgmma_a_operand(acc_layout, bits=16):
    """Register A-operand layout of a wgmma accumulating into ``acc_layout`` on ``bits``-bit
    operands (16: fp16/bf16; 8: fp8, four to a 32-bit register): P or dS kept in registers for
    the next product ("RS" wgmma)."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=32 // bits)


@gluon.constexpr_function
def pow2_floor(n):
    return 1 << (int(n).bit_length() - 1)


@gluon.jit
def mma_over_cols(a, b, acc, COLS: gl.constexpr, use_acc: gl.constexpr = False):
    """Asynchronous wgmma a·bᵀ (a [rows, d], b [n, d] in shared memory) over their first COLS
    columns (0: all of d). A head dim that is no power of two (96, 192) sits in a tile padded
    to the next one (zero-filled by TMA); COLS = d runs its columns as two power-of-two pieces
    (64 + 32, 128 + 64), two wgmma groups into one accumulator, instead of the padded width:
    a quarter fewer tensor-core cycles (a power of two below d: one group). Returns the last
    group's token (a wait that retires it retires both: groups complete in order)."""
    D: gl.constexpr = a.shape[1]
    if COLS == 0 or COLS == D:
        tok = warpgroup_mma(a, b.permute((1, 0)), acc, use_acc=use_acc, is_async=True)
    elif COLS == pow2_floor(COLS):  # ((192, 128): dP over V's 128 of 256 columns) one piece
        tok = warpgroup_mma(a.slice(0, COLS, 1), b.slice(0, COLS, 1).permute((1, 0)), acc,
                            use_acc=use_acc, is_async=True)
    else:
        C0: gl.constexpr = pow2_floor(COLS)
        C1: gl.constexpr = COLS - C0
        gl.static_assert(C1 > 0 and C1 == pow2_floor(C1) and C1 >= 16,
                         "COLS must be two powers of two of at least 16 columns")
        tok = warpgroup_mma(a.slice(0, C0, 1), b.slice(0, C0, 1).permute((1, 0)), acc,
                            use_acc=use_acc, is_async=True)
        tok = warpgroup_mma(a.slice(C0, C1, 1), b.slice(C0, C1, 1).permute((1, 0)), tok,
                            use_acc=True, is_async=True)
    return tok


@gluon.jit
def floor_div(a, b: gl.constexpr):
    # integer // truncates toward zero; block bounds need floor for negative numerators
    if a < 0:
        a = -((-a + b - 1) // b)
    else:
        a = a // b
    return a


@gluon.jit
def seq_bounds(CU_Q, CU_K, off_b, seqlen_q_fixed, seqlen_k_fixed, IS_VARLEN: gl.constexpr,
               PAGED: gl.constexpr = False):
    """(q_start, seqlen_q, k_start, seqlen_k, lse_start) of batch entry ``off_b``: first rows in
    the [rows, heads * d] views, lengths, and the first LSE column (varlen LSE is [h, total_q],
    batched [b, h, s_q]). PAGED: batched queries over a paged cache, CU_K holding the key counts
    (keys are then addressed through the page table, k_start 0), clamped into [0,
    seqlen_k_fixed], the cache's capacity per sequence (unchecked counts under CUDA graphs)."""
    if PAGED:
        q_start = off_b * seqlen_q_fixed
        seqlen_q = seqlen_q_fixed
        k_start = 0
        seqlen_k = gl.minimum(gl.maximum(gl.load(CU_K + off_b), 0), seqlen_k_fixed)
        lse_start = 0
    elif IS_VARLEN:
        q_start = gl.load(CU_Q + off_b)
        seqlen_q = gl.load(CU_Q + off_b + 1) - q_start
        k_start = gl.load(CU_K + off_b)
        seqlen_k = gl.load(CU_K + off_b + 1) - k_start
        lse_start = q_start
    else:
        q_start = off_b * seqlen_q_fixed
        seqlen_q = seqlen_q_fixed
        k_start = off_b * seqlen_k_fixed
        seqlen_k = seqlen_k_fixed
        lse_start = 0
    return q_start, seqlen_q, k_start, seqlen_k, lse_start


@gluon.jit
def query_tile(CU_Q, CU_K, n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed, window_left,
               window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_VARLEN: gl.constexpr,
               HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, PAGED: gl.constexpr = False,
               head_group=1):
    """This program's query tile on a (query tiles, batch * heads) grid, heaviest tiles first (the
    last ones under a causal mask, which shortens the tail). Returns (off_b, off_h, off_hk,
    q_start, seqlen_q, k_start, seqlen_k, lse_start, start_m, lo, n_tiles); the caller returns
    early when start_m >= seqlen_q. Key tiles of BLOCK_N from key lo, as ``key_tiles``.
    head_group != 1: the CTAs, in launch order, take the tiles in grouped heaviest-first order
    (``grouped_order``); 1: one head after another."""
    if head_group == 1:
        tile = gl.num_programs(0) - 1 - gl.program_id(0)
        pid_bh = gl.program_id(1)
    else:
        rank, pid_bh = grouped_order(gl.program_id(0) + gl.program_id(1) * gl.num_programs(0),
                                     gl.num_programs(0), head_group)
        tile = gl.num_programs(0) - 1 - rank
    return query_tile_at(tile, pid_bh, CU_Q, CU_K, n_heads, kv_group, seqlen_q_fixed,
                         seqlen_k_fixed, window_left, window_right, BLOCK_M, BLOCK_N, IS_VARLEN,
                         HAS_LEFT, HAS_RIGHT, PAGED)


@gluon.jit
def query_tile_at(tile_m, pid_bh, CU_Q, CU_K, n_heads, kv_group, seqlen_q_fixed, seqlen_k_fixed,
                  window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  IS_VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                  PAGED: gl.constexpr = False):
    """``query_tile`` of query tile ``tile_m`` (rows from tile_m * BLOCK_M) of batch * head
    ``pid_bh`` (a persistent kernel's tiles)."""
    off_b = pid_bh // n_heads
    off_h = pid_bh % n_heads
    q_start, seqlen_q, k_start, seqlen_k, lse_start = seq_bounds(CU_Q, CU_K, off_b, seqlen_q_fixed,
                                                                 seqlen_k_fixed, IS_VARLEN, PAGED)
    start_m = tile_m * BLOCK_M
    lo, n_tiles = key_tiles(start_m, BLOCK_M, seqlen_q, seqlen_k, window_left, window_right, BLOCK_N,
                            HAS_LEFT, HAS_RIGHT)
    return (off_b, off_h, off_h // kv_group, q_start, seqlen_q, k_start, seqlen_k, lse_start,
            start_m, lo, n_tiles)


def score_scales(softmax_scale: float, softcap: float) -> tuple[float, float | None]:
    """(qk_scale_log2, softcap_scale) of a launch: without softcap the softmax's score scale
    softmax_scale * log2 e and None (``softcap_tanh`` then leaves S alone); with softcap the
    kernels take tanh(S * softmax_scale / cap) and scale it by cap * log2 e."""
    if softcap > 0:
        return softcap * LOG2E, softmax_scale / softcap
    return softmax_scale * LOG2E, None


# softcap's tanh on the MUFU's tanh.approx.f32 (one instruction a score, 2^-11 relative error;
# FlashAttention-3's choice) instead of exp2 and a fast division (two, ~1e-7 absolute): the
# default since it ran 1.30-1.72x the exact form's forward and 1.04-1.14x its backward at cap 30
# (results/softcap{,_approx}_b84f621_*.json); IOATTN_SM90_SOFTCAP_APPROX=0 takes the exact form
SOFTCAP_APPROX = gl.constexpr(os.environ.get("IOATTN_SM90_SOFTCAP_APPROX", "1").lower()
                              in ("1", "true", "on"))


@gluon.jit
def softcap_tanh(s, softcap_scale):
    """Softcap's tanh(s * softcap_scale) of raw scores (the caller's qk_scale_log2 is then
    softcap * log2 e, so the softmax sees softcap * tanh(s * scale / softcap) in the log2
    domain); s unchanged when softcap_scale is None (no softcap: a compile-time branch).
    tanh(x) = 1 - 2 / (1 + e^2x): one exp2 and a fast division, saturating to +-1 without a
    branch; absolute error ~1e-7. SOFTCAP_APPROX: MUFU's tanh.approx, one instruction less at
    2^-11 relative error (0.02 on a score capped at 50, under the 0.1 of a bf16 score there)."""
    if softcap_scale is not None:
        if SOFTCAP_APPROX:
            s = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f",
                                          [s * softcap_scale], dtype=gl.float32, is_pure=True,
                                          pack=1)
        else:
            e2x = gl.exp2(s * (softcap_scale * 2.8853900817779268))  # e^2x: 2 log2(e) x
            s = 1.0 - gl.fdiv(gl.full_like(s, 2.0), 1.0 + e2x)
    return s


@gluon.jit
def zero_tail_rows(tile, first):
    """Zero rows [first, ROWS) of a [ROWS, COLS] tile in shared memory, in 8-row slices (the
    swizzle atom; 4 rows a warp, so 16-row slices from a warpgroup), from the calling partition's
    warps (a producer's one, or a consumer warpgroup): a TMA tile that crosses the end of the last packed sequence reads
    rows that belong to no sequence (a varlen tensor may be longer than cu_seqlens[-1], and such
    rows may hold NaN / Inf: torch.empty). Their scores are masked, but 0 * NaN in P·V, dS·K or
    dSᵀ·Q would still reach real outputs; zeroed rows contribute exactly 0. The caller waits for
    the TMA load first and fences (``fence_async_shared``) before wgmma reads the tile."""
    ROWS: gl.constexpr = tile.shape[0]
    COLS: gl.constexpr = tile.shape[1]
    WARPS: gl.constexpr = gl.num_warps()
    H: gl.constexpr = 8 if WARPS == 1 else 4 * WARPS  # rows a slice
    # [H, 64] pieces: 8-16 values per thread, within the producer's small register budget
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    r = gl.arange(0, H, layout=gl.SliceLayout(1, layout))
    for c in gl.static_range(ROWS // H):
        if c * H + H > first:
            for k in gl.static_range(COLS // 64):
                piece = tile.slice(c * H, H, dim=0).slice(k * 64, 64, dim=1)
                x = piece.load(layout)
                piece.store(gl.where((c * H + r >= first)[:, None], gl.zeros_like(x), x))


@gluon.jit
def zero_tail_cols(tile, first):
    """``zero_tail_rows`` for a tile laid out keys innermost ([ROWS, KEYS]: the fp8 forward's V
    tiles): zero its columns [first, KEYS), whole rows at a time in slices of at least 8 rows
    (the swizzle atom), in 8-byte vectors (one warp: 16 or 32 values a thread)."""
    ROWS: gl.constexpr = tile.shape[0]
    COLS: gl.constexpr = tile.shape[1]
    WARPS: gl.constexpr = gl.num_warps()
    TPC: gl.constexpr = COLS // 8 if COLS // 8 < 32 else 32  # threads along a row
    H: gl.constexpr = 32 // TPC * WARPS if 32 // TPC * WARPS >= 8 else 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [WARPS, 1], [1, 0])
    c = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    for i in gl.static_range(ROWS // H):
        piece = tile.slice(i * H, H, dim=0)
        x = piece.load(layout)
        piece.store(gl.where((c >= first)[None, :], gl.zeros_like(x), x))


@gluon.jit
def zero_last_key_tile(full, fixed, a_smem, b_smem, n_tiles, n_keys, STAGES: gl.constexpr,
                       BOTH: gl.constexpr, KEYS_INNER: gl.constexpr = False):
    """Producer side of ``zero_tail_rows`` for a stream of key tiles whose last one may run past
    the last packed sequence (n_keys keys from the stream's first): once that tile has landed
    (``full``), zero its rows past the end in a_smem (and b_smem when BOTH), then arrive on
    ``fixed``, which the consumers wait for before reading the last tile. KEYS_INNER: a_smem's
    tiles are [d, keys] (``zero_tail_cols``; not with BOTH)."""
    BLOCK_N: gl.constexpr = a_smem.shape[2] if KEYS_INNER else a_smem.shape[1]
    last = n_tiles - 1
    first = n_keys - last * BLOCK_N
    if (n_tiles > 0) & (first < BLOCK_N):
        mbarrier.wait(full.index(last % STAGES), (last // STAGES) & 1)
        if KEYS_INNER:
            zero_tail_cols(a_smem.index(last % STAGES), first)
        else:
            zero_tail_rows(a_smem.index(last % STAGES), first)
        if BOTH:
            zero_tail_rows(b_smem.index(last % STAGES), first)
        fence_async_shared()
        mbarrier.arrive(fixed, count=1)


@gluon.jit
def barriers(N: gl.constexpr, count: gl.constexpr):
    """N mbarriers ([N, 1], .index(i)), each completing after ``count`` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def invalidate(bars, N: gl.constexpr):
    for i in gl.static_range(N):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def key_tiles(start_m, rows, seqlen_q, seqlen_k, window_left, window_right, BLOCK_N: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """(lo, n_tiles): the BLOCK_N-key tiles from key ``lo`` that query rows [start_m, start_m + rows)
    may see."""
    off = seqlen_k - seqlen_q
    last_m = gl.minimum(start_m + rows, seqlen_q) - 1
    lo = 0
    hi = seqlen_k
    if HAS_LEFT:
        lo = gl.maximum(floor_div(start_m + off - window_left, BLOCK_N) * BLOCK_N, 0)
    if HAS_RIGHT:
        hi = gl.minimum(last_m + off + window_right + 1, seqlen_k)
    hi = gl.maximum(hi, lo)
    return lo, gl.cdiv(hi - lo, BLOCK_N)


@gluon.jit
def query_tiles(start_n, keys, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: gl.constexpr,
                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """(lo, n_tiles): the BLOCK_M-row query tiles from row ``lo`` that see some key of
    [start_n, start_n + keys)."""
    off = seqlen_k - seqlen_q
    last_n = gl.minimum(start_n + keys, seqlen_k) - 1
    lo = 0
    hi = seqlen_q
    if HAS_RIGHT:
        lo = gl.maximum(floor_div(start_n - off - window_right, BLOCK_M) * BLOCK_M, 0)
    if HAS_LEFT:
        hi = gl.minimum(last_n - off + window_left + 1, seqlen_q)
    hi = gl.maximum(hi, lo)
    return lo, gl.cdiv(hi - lo, BLOCK_M)


def rows_view(t: torch.Tensor, varlen: bool) -> tuple[int, int] | None:
    """(rows, row stride) of ``t`` as a row-major [rows, heads * d] matrix, or None if its strides
    do not allow that view (heads packed in a row; batches back to back). A single head's
    stride is never used (a [b, 1, s, d] tensor's transpose, MQA's K/V, has any)."""
    d = t.shape[-1]
    if t.stride(-1) != 1 or (t.shape[-2] > 1 and t.stride(-2) != d):
        return None
    if varlen:
        return t.shape[0], t.stride(0)
    b, s = t.shape[0], t.shape[1]
    if b > 1 and t.stride(0) != s * t.stride(1):
        return None
    return b * s, t.stride(1)


def tma_view_problem(name: str, t: torch.Tensor, varlen: bool) -> str | None:
    """Why ``t``'s layout cannot be read through a [rows, heads * d] TMA descriptor (None when
    it can). Shapes and strides only: the base address is unknown while torch.compile traces
    the dispatch, so a misaligned base is mended where the kernel is launched
    (``aligned_base``)."""
    view = rows_view(t, varlen)
    if view is None:
        return (f"{name}'s strides {tuple(t.stride())} do not form a row-major [rows, heads * "
                f"head_dim] matrix (TMA needs heads packed in a row)")
    if (view[1] * t.element_size()) % 16:
        return f"{name}'s row stride is not a multiple of 16 bytes, as TMA requires"
    return None


def base_problem(name: str, t: torch.Tensor) -> str | None:
    """Why ``t``'s base address cannot start a TMA descriptor (None when it can)."""
    if t.data_ptr() % 16:
        return f"{name}'s base address is not 16-byte aligned, as TMA requires"
    return None


# (d, d_v) the sm90 kernels run padded with zero columns to one head dim they are built for:
# Gluon tensors take power-of-two shapes only (d=96 fails to compile), so q, k, v (and dO, O in
# the backward) are copied into zero-padded tensors and the outputs cut back (zero columns add 0
# to every q·k and give zero output columns; the softmax scale is the caller's 1/sqrt(d)).
# (192, 128): DeepSeek's MLA prefill shape
PADDED_HEAD_DIMS = {(96, 96): 128, (192, 192): 256, (192, 128): 256}
# how the kernels pad them: "copy" (the op's zero-padded copies, timed on the H200) or "tma"
# (read in place through [rows, heads, d] views whose boxes the TMA unit zero-fills past d,
# stores clipped or masked there: no copies; the default since it ran 1.1-2.2x the copies on
# the H200, results/pad_tma_ae73752_*.json against pad_copy_ae73752_*.json, NOTES session 15)
PAD_MODE = os.environ.get("IOATTN_SM90_PAD", "tma").lower()
if PAD_MODE not in ("copy", "tma"):
    raise ValueError(f"IOATTN_SM90_PAD={PAD_MODE!r}: expected 'copy' or 'tma'")
# (tma mode) QKᵀ over d's own columns, two power-of-two pieces (``mma_over_cols``: 96 as
# 64 + 32, 192 as 128 + 64) instead of the padded width, and in the forward V / O in tiles of
# d_v's own width where it is a power of two ((192, 128): PV at 128 columns, not 256); the
# backward's dQ and column-split dK/dV kernels form S and dP over d's / d_v's own columns.
# Tensor-core work a forward tile against the padded form: (192, 128) 320 / 512, (192, 192)
# 448 / 512, (96, 96) 224 / 256. The default since it ran 1.00-1.49x the padded form in every
# cell timed on the H200 (results/pad_narrow{1,0}_d90c06b_*.json, NOTES session 17)
PAD_NARROW = os.environ.get("IOATTN_SM90_PAD_NARROW", "1").lower() in ("1", "true", "on")


def narrow_dv(d_v: int) -> int | None:
    """V's and O's tile width under PAD_NARROW: d_v padded to a power of two (None: d_v is one,
    read as it is)."""
    p2 = triton.next_power_of_2(d_v)
    return None if p2 == d_v else p2


def padded_operands(named: tuple, d_pad: int, varlen: bool) -> tuple[list, int | None]:
    """(tensors, d_pad) that the sm90 kernels read for operands (name, tensor) of a zero-padded
    head dim (PADDED_HEAD_DIMS[(d, d_v)] = d_pad): zero-padded copies and d_pad (the caller cuts
    its outputs back), or with PAD_MODE "tma" the tensors themselves (made contiguous where TMA
    cannot view them) and None: the launchers pad their tiles in place."""
    if PAD_MODE == "tma":
        return [tma_readable(n, t, varlen) for n, t in named], None
    return [pad_head_dim(t, d_pad) for _, t in named], d_pad


def tma_readable(name: str, t: torch.Tensor, varlen: bool) -> torch.Tensor:
    """``t`` as the sm90 kernels' TMA reads it: itself, or a contiguous copy where its layout
    allows no [rows, heads * d] view (``tma_view_problem``: an upstream transpose or expand)."""
    return t.contiguous() if tma_view_problem(name, t, varlen) is not None else t


def head_group_size(n_bh: int, n_blocks: int, slots: int) -> int:
    """Heads per group of the grouped heaviest-first order (``grouped_order``): about one wave
    of ``slots`` concurrent CTAs / tiles across the group's ``n_blocks`` blocks a head, and a
    divisor of the ``n_bh`` (batch * heads) it groups."""
    target = max(1, round(slots / max(1, n_blocks)))
    return max(g for g in range(1, min(target, n_bh) + 1) if n_bh % g == 0)


@gluon.jit
def grouped_order(p, n_blocks, group):
    """Position p of a launch's (block, head) work order as (block rank, head): heads in groups
    of ``group`` (a divisor of their count), each group's blocks rank by rank across its heads
    (rank 0, the heaviest under a causal mask, of every head first). The greedy schedule of the
    hardware (or of a persistent kernel's tile counter) then ends on light blocks instead of a
    head's heavy first block, where one head after another leaves a tail: simulated on the FA
    grid's causal shapes with one CTA a SM, 3-7% over the ideal from 2k to 8k against 0.1-1.6%
    grouped (benchmarks/NOTES.md, session 15). group 1 is one head after another, heaviest
    first: (p % n_blocks, p // n_blocks)."""
    span = group * n_blocks
    g = p // span
    r = p - g * span
    return r // group, g * group + r % group


@gluon.jit
def grid_dependency_wait():
    """PTX ``griddepcontrol.wait``: block until the grids this one depends on (the stream's
    previous kernel, when this one was launched with ``launch_pdl=True``: programmatic
    dependent launch) have completed and their writes are visible; a no-op otherwise. Before
    it, a PDL-launched CTA may run while its predecessor's last CTAs still do, so nothing the
    predecessor writes (or reads: a later write of ours) may be touched before it."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def launch_dependents():
    """PTX ``griddepcontrol.launch_dependents``: once every CTA of this grid has issued it (or
    exited), the stream's next kernel, if launched with ``launch_pdl=True``, may start its
    CTAs (they wait in ``grid_dependency_wait`` for this grid to complete)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


def pad_head_dim(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t`` [..., d0] as a contiguous [..., d] tensor, columns past d0 zero (one pass: each
    element written once, where zeros-then-copy wrote the first d0 columns twice)."""
    return torch.nn.functional.pad(t, (0, d - t.shape[-1])).contiguous()


def aligned_base(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy when its base is not 16-byte aligned (a view that starts
    mid-row): for read-only kernel inputs, whose layout ``tma_view_problem`` has accepted."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=64)
def shared_layout(rows: int, cols: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The NVMMA shared layout of a [rows, cols] TMA box: built once per shape (its Python
    construction was the largest ioattn-side host cost of a decode launch, benchmarks/NOTES.md)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], GL_DTYPES[dtype])


@functools.lru_cache(maxsize=16)
def shared_layout_3d(rows: int, cols: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The [rows, 1, cols] box's layout (built once per shape, as ``shared_layout``)."""
    return nvmma_at_rank(shared_layout(rows, cols, dtype), 3)


def rows_descriptor(t: torch.Tensor, varlen: bool, block_rows: int,
                    block_cols: int | None = None, pad_to: int | None = None) -> Desc:
    """Host TMA descriptor of ``t`` as [rows, heads * d] with [block_rows, block_cols] boxes
    (block_cols d by default), as ``ioattn.launch.Desc``: launched through ``launch.launcher``,
    which checks it as gluon's ``TensorDescriptor`` the first time its signature is seen.
    pad_to > d: as [rows, heads, d] with [block_rows, 1, pad_to] boxes instead, the kernels'
    tiles zero-padded to pad_to columns (``tma_load``; stores clipped at d)."""
    d = t.shape[-1]
    cols = block_cols or d
    rows, row_stride = rows_view(t, varlen)
    if pad_to is not None and pad_to != d:
        layout = shared_layout_3d(block_rows, pad_to, t.dtype)
        return Desc(t, (rows, t.shape[-2], d), (row_stride, d, 1), (block_rows, 1, pad_to), layout)
    layout = shared_layout(block_rows, cols, t.dtype)
    return Desc(t, (rows, t.shape[-2] * d), (row_stride, 1), (block_rows, cols), layout)

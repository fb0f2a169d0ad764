"""Pieces shared by the dense forward and backward Triton kernels.

Conventions (all kernels of this family):
- the diagonal offset ``off = seqlen_k - seqlen_q`` aligns causal/window masks bottom-right (FA2);
- query row ``i`` may see key ``j`` iff ``i + off - left <= j <= i + off + right``; a negative window
  side is unbounded, encoded by the constexpr flags ``HAS_LEFT`` / ``HAS_RIGHT``;
- scores live in the log2 domain inside the kernels (``exp2``), the LSE leaves them in natural log.
"""
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def cdiv(a: int, b: int) -> int:
    """Ceil division on the host (triton.cdiv is a jit function: ~6 us per host call)."""
    return -(-a // b)
LN2 = 0.6931471805599453


@triton.jit
def seq_bounds(CU_Q, CU_K, off_b, seqlen_q_fixed, seqlen_k_fixed, IS_VARLEN: tl.constexpr):
    """(q_start, seqlen_q, k_start, seqlen_k, rng_q0) of batch entry ``off_b``.

    Varlen reads cu_seqlens; the batched layout is the varlen case with equal lengths (rows start
    at 0 of each batch entry, whose offset comes from the batch stride). rng_q0 is the entry's
    first row among all query rows of the batch (dropout's Philox row index).
    """
    if IS_VARLEN:
        q_start = tl.load(CU_Q + off_b)
        seqlen_q = tl.load(CU_Q + off_b + 1) - q_start
        k_start = tl.load(CU_K + off_b)
        seqlen_k = tl.load(CU_K + off_b + 1) - k_start
        rng_q0 = q_start
    else:
        # tensors (not constexprs, which 1 would become) so every caller can .to() them
        q_start = off_b * 0
        k_start = off_b * 0
        seqlen_q = q_start + seqlen_q_fixed
        seqlen_k = k_start + seqlen_k_fixed
        rng_q0 = off_b * seqlen_q_fixed
    return q_start, seqlen_q, k_start, seqlen_k, rng_q0


@triton.jit
def kv_sources(k_base, v_base, seqlen_k, stride_kn, stride_vn, offs_n, offs_d, offs_dv,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, USE_TMA: tl.constexpr,
               V_T: tl.constexpr = False):
    """K/V tiles' sources for loops over key blocks: TMA descriptors bounded by seqlen_k (rows past
    it and head-dim padding read as 0) or [BLOCK_N, BLOCK_D] pointer blocks at key block 0.
    V_T: V's keys are contiguous (stride_vn is then its head dim's stride; the fp8 forward's
    V, whose wgmma operand wants keys innermost): its descriptor is [HEAD_DIM_V, seqlen_k]."""
    if USE_TMA:
        k_src = tl.make_tensor_descriptor(k_base, shape=[seqlen_k, HEAD_DIM], strides=[stride_kn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        if V_T:
            v_src = tl.make_tensor_descriptor(v_base, shape=[HEAD_DIM_V, seqlen_k],
                                              strides=[stride_vn, 1], block_shape=[BLOCK_DV, BLOCK_N])
        else:
            v_src = tl.make_tensor_descriptor(v_base, shape=[seqlen_k, HEAD_DIM_V],
                                              strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_DV])
    else:
        # scalar bases: the tile addresses are formed at each load (a hoisted [BLOCK_N, BLOCK_D]
        # int64 pointer block would pin 2 registers per element across the loop and spill)
        k_src = k_base
        v_src = v_base
    return k_src, v_src


@triton.jit
def load_kv_block(src, start_n, stride_n, cols, offs_d, seqlen_k, HEAD_DIM: tl.constexpr,
                  MASKED: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
                  KEYS_CONTIG: tl.constexpr = False):
    """The [BLOCK_N, BLOCK_D] tile of K or V at key block ``start_n`` from a ``kv_sources`` source;
    cols = start_n + arange(BLOCK_N). Masked blocks guard rows past seqlen_k (TMA zero-fills them).
    KEYS_CONTIG: a ``V_T`` source (keys contiguous, stride_n the head dim's stride)."""
    if USE_TMA and KEYS_CONTIG:
        x = tl.trans(src.load([0, start_n]))
    elif USE_TMA:
        x = src.load([start_n, 0])
    else:
        if KEYS_CONTIG:
            ptrs = src + cols[:, None] + offs_d[None, :] * stride_n
        else:
            ptrs = src + cols[:, None] * stride_n + offs_d[None, :]
        if MASKED:
            x = tl.load(ptrs, mask=(cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def floor_div(a, b: tl.constexpr):
    # Triton's integer // truncates toward zero; block bounds need floor for negative numerators.
    return tl.where(a >= 0, a // b, -((-a + b - 1) // b))


@triton.jit
def kv_block_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key blocks a query block [start_m, start_m + BLOCK_M) visits.

    Returns (lo, full_lo, full_hi, hi): [lo, hi) holds every key a live row of the block may see;
    [full_lo, full_hi) are BLOCK_N-aligned blocks where no element is masked, so the kernel skips
    the mask there. lo, full_lo, full_hi are multiples of BLOCK_N.
    """
    off = seqlen_k - seqlen_q
    last_m = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    lo = 0
    hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(floor_div(start_m + off - window_left, BLOCK_N) * BLOCK_N, 0)
    if HAS_RIGHT:
        hi = tl.minimum(last_m + off + window_right + 1, seqlen_k)
    hi = tl.maximum(hi, lo)
    full_lo = lo
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        full_lo = (floor_div(last_m + off - window_left + BLOCK_N - 1, BLOCK_N)) * BLOCK_N
    if HAS_RIGHT:
        full_hi = tl.minimum(full_hi, floor_div(start_m + off + window_right + 1, BLOCK_N) * BLOCK_N)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def q_block_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query blocks that see some key of [start_n, start_n + BLOCK_N) (the backward's view).

    Returns (lo, full_lo, full_hi, hi) over query rows, as kv_block_range does over keys.
    """
    off = seqlen_k - seqlen_q
    last_n = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    lo = 0
    hi = seqlen_q
    if HAS_RIGHT:
        lo = tl.maximum(floor_div(start_n - off - window_right, BLOCK_M) * BLOCK_M, 0)
    if HAS_LEFT:
        hi = tl.minimum(last_n - off + window_left + 1, seqlen_q)
    hi = tl.maximum(hi, lo)
    full_lo = lo
    full_hi = (seqlen_q // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:
        full_lo = floor_div(start_n + BLOCK_N - 1 - off - window_right + BLOCK_M - 1, BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        full_hi = tl.minimum(full_hi, floor_div(start_n - off + window_left + 1, BLOCK_M) * BLOCK_M)
    # a key block cut by seqlen_k needs its mask on every query block
    full_hi = tl.where(start_n + BLOCK_N > seqlen_k, 0, full_hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def visible(rows, cols, seqlen_k, off, window_left, window_right,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Mask of (query row, key) pairs that attend.

    rows / cols are index tensors already shaped for broadcasting ([M, 1] and [1, N], or transposed
    [1, M] and [N, 1] in the backward), so the mask comes out in the caller's orientation.
    """
    mask = cols < seqlen_k
    if HAS_RIGHT:
        mask = mask & (cols <= rows + off + window_right)
    if HAS_LEFT:
        mask = mask & (cols >= rows + off - window_left)
    return mask


@triton.jit
def tanh_f32(x):
    # tanh through exp2 keeps the kernels portable (interpreter, any arch); accurate in fp32
    t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def scores_log2(qk, rows, cols, off, qk_scale_log2, softcap_scale, softcap_log2, slope_log2,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Raw q·k (fp32) -> (s, t, c) with ``s * c`` the score in the log2 domain, t = tanh (softcap).

    No softcap: s * c = qk * scale * log2e. Softcap: cap * tanh(qk * scale / cap) * log2e.
    ALiBi adds -slope * |i + off - j| (times log2e) after the softcap, as FA2 does.
    In the plain case s stays the raw qk and c is the scale, so the callers' ``exp2(s * c - m)``
    is one FMA per element (the softmax, not the matmuls, limits small head dims).
    rows / cols broadcast as in ``visible``.
    """
    if HAS_SOFTCAP:
        t = tanh_f32(qk * softcap_scale)
        s = t * softcap_log2
    else:
        t = qk
        s = qk
    if HAS_ALIBI:
        if not HAS_SOFTCAP:
            s = qk * qk_scale_log2
        dist = tl.abs(rows + off - cols).to(tl.float32)
        s = s - slope_log2 * dist
    if HAS_SOFTCAP or HAS_ALIBI:
        c = 1.0
    else:
        c = qk_scale_log2
    return s, t, c


@triton.jit
def dropout_keep(seed, rng_row0, rows, cols, max_seqlen_k, dropout_p):
    """Philox keep-mask; the same (row, key) pair gives the same bit in fwd and bwd.

    rng_row0 is the int64 index of this program's row 0 among all (head, query row) pairs;
    rows / cols broadcast as in ``visible``.
    """
    offsets = (rng_row0 + rows.to(tl.int64)) * max_seqlen_k + cols.to(tl.int64)
    return tl.rand(seed, offsets) >= dropout_p


# ---- host side ----

def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and 16-byte multiples for every outer stride."""
    for t in tensors:
        esize = t.element_size()
        if t.data_ptr() % 16 or any((st * esize) % 16 for st in t.stride()[:-1]):
            return False
    return True


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Device-side TMA descriptors need a small global scratch per program.

    Triton keeps its allocator in a ContextVar, so it must be set in the launching thread: autograd
    runs the backward in its own worker thread (seen on the H200: "Kernel requires a runtime memory
    allocation"). An allocator the caller set is kept; only Triton's null default is replaced.
    """
    try:
        from triton.runtime import _allocation
        current = _allocation._allocator.get()
        if not isinstance(current, _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # private layout changed: set ours, always valid
        pass
    triton.set_allocator(_torch_scratch)

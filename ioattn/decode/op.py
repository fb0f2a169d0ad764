"""torch.library op of the KV-cache family: append (rotary) + attention in one op that mutates
the caches, with a fake impl so torch.compile traces it. Attention runs in the split-KV kernel
over the cache, or, for long query chunks (chunked prefill): on Hopper in the sm90 forward reading
the pages through TMA (``sm90_paged``), elsewhere (or where that kernel does not cover the call)
in the dense varlen forward over K/V gathered out of the cache (``gathers``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ioattn.decode.triton_decode import gather_kv, kvcache_attn, rope_store
from ioattn.dense.api import _pick
from ioattn.dense.op import _new_output, _on_device, fwd_impl
from ioattn.dispatch import sm_count

# The gathered path's switch: None lets ``gathers`` decide; True / False take it always / never
# (tests force it on CPU, where the rule never picks it, to run it under the interpreter).
FORCE_GATHER: Optional[bool] = None
# The rule's thresholds (``gathers`` explains them).
GATHER_MIN_TOKENS = 128  # query tokens per sequence: a full query tile of the dense kernels
GATHER_MIN_ROWS = 512  # query tokens x GQA group: the query rows that read each gathered key
GATHER_MAX_BYTES = 1 << 30  # packed K and V together
# The sm90 paged forward's switch (``sm90_paged``): None lets the rule decide, False never,
# True whenever it covers the call (tests, past the launch-shape guards).
FORCE_SM90_PAGED: Optional[bool] = None


def fills_gpu(q: Tensor) -> bool:
    """Whether q's 128-row query tiles (one head's tokens each) are at least one per SM: the
    dense kernels, which the long-chunk paths run, do not split the keys, so a short batch of
    chunks (1 x 128 tokens x 32 heads: 32 tiles on 132 SMs) would leave most SMs idle where the
    split-KV kernel spreads the keys over programs. A guard from the launch shape, not measured."""
    b, s_q, h, _ = q.shape
    return -(-s_q // 128) * b * h >= sm_count(q.device)


def sm90_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Optional[Tensor],
               cache_leftpad: Optional[Tensor], cache_batch_idx: Optional[Tensor],
               alibi_slopes: Optional[Tensor], softcap: float, num_splits: int,
               portable_only: bool) -> bool:
    """Whether attention runs in the sm90 (Gluon) forward reading the pages directly: its
    producer issues one TMA copy per page run, so long query chunks get the dense kernel's tiles
    without the gathered path's copy (H200, 8 x (4096 + 512) tokens, pages of 16: 587 TFLOP/s,
    1.01x the dense forward on the same keys; results/chunked_dense_sm90_nvidia-h200_2026-11-29.json).
    Taken on Hopper for query chunks of at least ``GATHER_MIN_TOKENS`` tokens (the kernel's
    128-row tiles hold one head's tokens) that give every SM a tile (``fills_gpu``), when it
    covers the call (``sm90_fwd.paged_unsupported_reason``: K and V each a contiguous pool of
    pages of a multiple of 8 keys, no ALiBi / leftpad); never for backend='triton' or
    an explicit num_splits > 1."""
    if FORCE_SM90_PAGED is False or portable_only or num_splits > 1 or not q.is_cuda:
        return False
    if FORCE_SM90_PAGED is None and (q.shape[1] < GATHER_MIN_TOKENS or not fills_gpu(q)):
        return False
    from ioattn.dense.sm90_fwd import paged_unsupported_reason
    from ioattn.dispatch import sm90_unavailable_reason

    return sm90_unavailable_reason(q.device) is None and paged_unsupported_reason(
        q, k_cache, v_cache, block_table, softcap, alibi_slopes is not None,
        cache_leftpad is not None, cache_batch_idx is not None) is None


def gathers(q: Tensor, k_cache: Tensor, capacity: int, num_splits: int) -> bool:
    """Whether attention runs as a gather of the keys into packed K/V plus the dense varlen
    forward, instead of the split-KV kernel over the cache.

    Measured on the H200 (chunked prefill, 8 sequences of 4096 cached + 512 new tokens, page 16,
    32 / 8 heads, d=128, causal): the split-KV kernel 230 TFLOP/s, a torch gather then the dense
    forward 410, the dense forward alone 451. The dense kernels stream contiguous K/V (TMA, deeper
    pipelines, larger tiles); the paged kernel forms a gathered address per key row. The copy reads and writes each key once, amortized over the s_q * group query rows
    that read it: relative to the attention it takes about elem_bytes * F / (B * s_q * group),
    F ~450 TFLOP/s the dense rate and B ~3.5 TB/s the copy's bytes read and written per second,
    i.e. 258 / (s_q * group) in 16-bit types: 13% at the measured cell (0.89x dense predicted;
    0.73-0.93x measured over six runs), 50% at 512 rows, where the gathered path (~0.67x dense) still beats the
    split kernel's 0.51x of the measured cell. The rule (estimates to re-measure):

    - a CUDA device: under the interpreter nothing pays (``FORCE_GATHER`` runs it there);
    - ``num_splits`` 0 or 1: an explicit split count asks for the split-KV kernel;
    - s_q >= ``GATHER_MIN_TOKENS``: the dense kernels tile one head's tokens (64 or 128 rows), so
      shorter chunks leave their tiles part empty, where the paged kernel fills its tiles with the
      tokens times the GQA group;
    - s_q * group >= ``GATHER_MIN_ROWS``: the copy's share above;
    - a query tile per SM at least (``fills_gpu``): the dense forward does not split the keys;
    - packed K and V (b * capacity rows each) within ``GATHER_MAX_BYTES``: a transient allocation
      beside caches that serving engines size to fill the memory; and since the lengths are on
      the device, the buffers are sized (and written, zeros past the keys) by the capacity, so
      this also bounds the copy (~0.3 ms per GiB moved) when the sequences are far shorter;
    - q's rows of one sequence within int32 indexing (``check_int32_rows`` of the dense op).

    Every feature of the call is covered by the portable dense kernel (softcap, ALiBi (h,) or
    (b, h), windows, GQA, head dims to 256); the sm90 one runs where 'auto' would pick it."""
    b, s_q, h, d = q.shape
    if FORCE_GATHER is not None or q.numel() == 0 or capacity == 0:
        return bool(FORCE_GATHER) and q.numel() > 0 and capacity > 0
    group = h // k_cache.shape[2]
    packed_bytes = 2 * b * capacity * k_cache.shape[2] * d * q.element_size()
    return (q.is_cuda and num_splits <= 1 and s_q >= GATHER_MIN_TOKENS
            and s_q * group >= GATHER_MIN_ROWS and packed_bytes <= GATHER_MAX_BYTES
            and (s_q + 256) * max(q.stride(1), h * d) < 2**31 and fills_gpu(q))


def _gathered_attn(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens_k: Tensor,
                   cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                   cache_batch_idx: Optional[Tensor], alibi_slopes: Optional[Tensor],
                   softmax_scale: float, window_left: int, window_right: int, softcap: float,
                   capacity: int, portable_only: bool) -> tuple[Tensor, Tensor]:
    """Attention as ``kvcache_attn`` through packed K/V and the dense varlen forward (op level:
    the public function's value checks would sync). Dropping the left padding shifts key
    positions and seqlen_k alike, so the bottom-right aligned masks and ALiBi distances, which
    depend only on key position - seqlen_k, are unchanged."""
    b, s_q, h, d = q.shape
    k_packed = _new_output(q, (b * capacity, k_cache.shape[2], d))
    v_packed = _new_output(q, k_packed.shape)
    cu_k = seqlens_k.new_empty(b + 1)
    gather_kv(k_cache, v_cache, seqlens_k, cache_leftpad, block_table, cache_batch_idx, k_packed,
              v_packed, cu_k)
    cu_q = torch.arange(0, (b + 1) * s_q, s_q, dtype=torch.int32, device=q.device)
    q_packed = q.reshape(b * s_q, h, d)
    impl, _ = _pick("triton" if portable_only else "auto", q_packed, k_packed, v_packed, softcap,
                    alibi_slopes, 0.0, varlen=True, masked=window_left >= 0 or window_right >= 0,
                    max_seqlen_q=s_q, max_seqlen_k=capacity,
                    windowed=window_left >= 0 or window_right > 0)
    with torch.no_grad():  # like the split kernel's, these outputs carry no autograd graph
        out, lse = fwd_impl(q_packed, k_packed, v_packed, cu_q, cu_k, s_q, capacity,
                            softmax_scale, window_left, window_right, softcap, alibi_slopes, 0.0,
                            None, impl)
    # the varlen LSE is [h, total_q]
    return out.view(b, s_q, h, -1), lse.view(h, b, s_q).transpose(0, 1).contiguous()


def kvcache_forward(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                    v: Optional[Tensor], rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor],
                    cache_seqlens: Tensor, cache_batch_idx: Optional[Tensor],
                    cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                    alibi_slopes: Optional[Tensor], softmax_scale: float, window_left: int,
                    window_right: int, softcap: float, rotary_interleaved: bool,
                    num_splits: int, portable_only: bool = False) -> tuple[Tensor, Tensor]:
    """The op's implementation, also called directly by eager callers (``eager``).

    Arguments as ``flash_attn_with_kvcache`` (validated there); cache_seqlens int32 [b].
    portable_only (backend='triton' asked for): the gathered path's dense forward stays on the
    portable Triton kernel, never the sm90 Gluon one. Returns (out [b, s_q, h, d], lse [b, h, s_q] fp32, natural log)."""
    b, s_q, h, d = q.shape
    local = window_left >= 0 or window_right >= 0
    # the kernels read index vectors, slopes and table rows with unit stride, and token rows of
    # q / k / v with a contiguous head dim: copy views that are laid out otherwise
    q, k, v = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes = (
        t if t is None else t.contiguous()
        for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes))
    with _on_device(q):
        if rotary_cos is not None:
            q_rot = torch.empty_like(q)
            rope_store(q, q_rot, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved,
                       per_token_pos=local, leftpad=cache_leftpad)
            q = q_rot
        seqlens_k = cache_seqlens
        if k is not None:
            rope_store(k, k_cache, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved,
                       per_token_pos=True, leftpad=cache_leftpad, block_table=block_table,
                       cache_batch_idx=cache_batch_idx, to_cache=True)
            rope_store(v, v_cache, cache_seqlens, None, None, False, per_token_pos=True,
                       leftpad=cache_leftpad, block_table=block_table,
                       cache_batch_idx=cache_batch_idx, to_cache=True)
            seqlens_k = cache_seqlens + k.shape[1]
        capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
        on_sm90 = sm90_paged(q, k_cache, v_cache, block_table, cache_leftpad, cache_batch_idx,
                             alibi_slopes, softcap, num_splits, portable_only)
        if not on_sm90 and gathers(q, k_cache, capacity, num_splits):
            return _gathered_attn(q, k_cache, v_cache, seqlens_k, cache_leftpad, block_table,
                                  cache_batch_idx, alibi_slopes, softmax_scale, window_left,
                                  window_right, softcap, capacity, portable_only)
        out = _new_output(q, (b, s_q, h, v_cache.shape[-1]))
        lse = _new_output(q, (b, h, s_q), dtype=torch.float32)
        if on_sm90:
            from ioattn.dense.sm90_fwd import attn_fwd_sm90_paged

            attn_fwd_sm90_paged(q, k_cache, v_cache, block_table, seqlens_k, softmax_scale,
                                window_left, window_right, out, lse, softcap)
        elif out.numel():
            kvcache_attn(q, k_cache, v_cache, seqlens_k, cache_leftpad, block_table,
                         cache_batch_idx, alibi_slopes, softmax_scale, window_left, window_right,
                         softcap, num_splits, out, lse)
    return out, lse


def paged_capacity(block_table: Tensor, page_size: int, max_seqlen_k: int) -> int:
    """Packed rows per sequence of a paged varlen call: its longest sequence's keys, at most
    what a block-table row holds (engines pass full-width tables)."""
    return max(0, min(block_table.shape[1] * page_size, max_seqlen_k))


def gather_pages(k_pages: Tensor, v_pages: Tensor, cu_seqlens_k: Tensor, block_table: Tensor,
                 max_seqlen_k: int) -> tuple[Tensor, Tensor]:
    """A paged varlen call's keys (``flash_attn_varlen_func(..., block_table=...)``): sequence
    i's first cu_seqlens_k[i + 1] - cu_seqlens_k[i] cache slots, through its block-table row,
    copied into packed K/V [batch * capacity, h_k, d] at rows cu_seqlens_k[i].. (zeros after
    the last key; capacity = ``paged_capacity``). Lengths stay on the device: no host sync, so
    CUDA graphs capture it."""
    b = block_table.shape[0]
    capacity = paged_capacity(block_table, k_pages.shape[1], max_seqlen_k)
    rows = b * capacity
    with _on_device(k_pages):
        k_out = _new_output(k_pages, (rows,) + tuple(k_pages.shape[2:]))
        v_out = _new_output(v_pages, (rows,) + tuple(v_pages.shape[2:]))
        cu = cu_seqlens_k.contiguous()
        seqlens = (cu[1:] - cu[:-1]).to(torch.int32)
        cu_packed = cu.new_empty(b + 1)  # (the same prefix sums as cu_seqlens_k)
        # (the kernel reads a table row with unit stride)
        gather_kv(k_pages, v_pages, seqlens, None, block_table.contiguous(), None, k_out, v_out,
                  cu_packed, capacity)
    return k_out, v_out


def paged_varlen_attn(q: Tensor, k_pages: Tensor, v_pages: Tensor, cu_seqlens_q: Tensor,
                      cu_seqlens_k: Tensor, block_table: Tensor, max_seqlen_q: int,
                      softmax_scale: float, window_left: int, window_right: int,
                      softcap: float) -> tuple[Tensor, Tensor]:
    """A paged varlen call's attention straight over the pages (the planned prefill kernel,
    without packing the keys): for calls whose packed K/V would be too large to copy
    (``PAGED_VARLEN_MAX_BYTES``). q [total_q, h, d] -> out [total_q, h, d], LSE [h, total_q]
    (natural log). The work list covers max_seqlen_q's row blocks for every request, built on
    the device (no host sync); blocks past a request's rows exit at once."""
    from ioattn.decode.triton_decode import paged_attn, paged_tiles

    q = q if q.stride(-1) == 1 else q.contiguous()  # (the kernel reads q's rows contiguous)
    total_q, h, d = q.shape
    b, width = block_table.shape
    group = h // k_pages.shape[2]
    block_m = paged_tiles(group, d, rows_per_request=max(max_seqlen_q, 1),
                          extras=softcap > 0 or window_right >= 0 or window_left >= 0)[0]
    blocks = max(1, -(-max(max_seqlen_q, 1) * group // block_m))
    with _on_device(q):
        out = _new_output(q, (total_q, h, v_pages.shape[-1]))
        lse = _new_output(q, (total_q, h), dtype=torch.float32)
        dev = q.device
        cu_k = cu_seqlens_k.to(torch.int32)
        lens = cu_k[1:] - cu_k[:-1]
        kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * width
        seqlens_indptr = torch.cat([lens, kv_indptr, cu_seqlens_q.to(torch.int32)])
        items = torch.arange(b * blocks, dtype=torch.int32, device=dev)
        work = torch.stack([items // blocks, items % blocks, torch.zeros_like(items),
                            torch.full_like(items, width * k_pages.shape[1]),
                            torch.full_like(items, -1)], 1).contiguous()
        n_work = torch.full((1,), b * blocks, dtype=torch.int32, device=dev)
        if b * blocks and total_q:
            paged_attn(q, k_pages, v_pages, block_table.contiguous().view(-1), seqlens_indptr,
                       work, n_work, None, b * blocks, 1, block_m, lse, lse, softmax_scale,
                       window_left, window_right, softcap, out, lse, lse_base2=False)
        else:
            out.zero_()
            lse.fill_(float("-inf"))
    return out, lse.t().contiguous()


# packed K + V bytes above which a paged varlen call attends over the pages instead of copying
# them (``paged_varlen_attn``); None: that rule, True / False: always / never (tests)
PAGED_VARLEN_MAX_BYTES = 1 << 30
FORCE_PAGED_VARLEN: Optional[bool] = None


def paged_varlen_copies(k_pages: Tensor, batch: int, capacity: int) -> bool:
    """Whether a paged varlen call packs its keys (``gather_pages``) or attends over the pages
    (``paged_varlen_attn``): the copy runs the dense varlen kernels (sm90 on Hopper) at the
    price of moving each key once and holding batch * capacity rows of K and V."""
    if FORCE_PAGED_VARLEN is not None:
        return not FORCE_PAGED_VARLEN
    rows = batch * capacity
    return 2 * rows * k_pages.shape[2] * k_pages.shape[3] * k_pages.element_size() \
        <= PAGED_VARLEN_MAX_BYTES


paged_varlen_attn_op = torch.library.custom_op("ioattn::paged_varlen_attn", paged_varlen_attn,
                                               mutates_args=())


@paged_varlen_attn_op.register_fake
def _(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, softmax_scale,
      window_left, window_right, softcap):
    total_q, h, _ = q.shape
    return (q.new_empty((total_q, h, v_pages.shape[-1])),
            q.new_empty((h, total_q), dtype=torch.float32))


gather_pages_op = torch.library.custom_op("ioattn::gather_pages", gather_pages, mutates_args=())


@gather_pages_op.register_fake
def _(k_pages, v_pages, cu_seqlens_k, block_table, max_seqlen_k):
    rows = block_table.shape[0] * paged_capacity(block_table, k_pages.shape[1], max_seqlen_k)
    return (k_pages.new_empty((rows,) + tuple(k_pages.shape[2:])),
            v_pages.new_empty((rows,) + tuple(v_pages.shape[2:])))


kvcache_fwd = torch.library.custom_op("ioattn::kvcache_fwd", kvcache_forward,
                                     mutates_args=("k_cache", "v_cache"))


def eager(*args) -> tuple[Tensor, Tensor]:
    """``kvcache_fwd`` outside torch.compile, without the custom-op dispatch: for a mutable op
    with this many arguments, torch's eager bookkeeping (``fill_defaults`` in the
    ADInplaceOrView kernel) cost ~150 us of host time per call, more than a decode step's
    kernel. Same kernels; the mutated caches' version counters are bumped as the op would."""
    out, lse = kvcache_forward(*args)
    if args[3] is not None:  # k given: the new tokens were written into both caches
        torch.autograd.graph.increment_version(args[1])
        torch.autograd.graph.increment_version(args[2])
    return out, lse


@kvcache_fwd.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
      cache_leftpad, block_table, alibi_slopes, softmax_scale, window_left, window_right, softcap,
      rotary_interleaved, num_splits, portable_only=False):
    b, s_q, h, _ = q.shape
    return (q.new_empty((b, s_q, h, v_cache.shape[-1])),
            q.new_empty((b, h, s_q), dtype=torch.float32))

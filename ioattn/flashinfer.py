"""FlashInfer-compatible calls: same names, arguments and semantics as ``flashinfer`` (0.2-0.7),
so call sites switch by import (``import ioattn.flashinfer as flashinfer``).

Conventions as FlashInfer: page tables are int32 CSR (``indptr``, ``indices``, ``last_page_len``);
a paged cache is one tensor [pages, 2, page_size, H_kv, D] (NHD) / [pages, 2, H_kv, page_size, D]
(HND) or a (k, v) tuple of [pages, page_size, H_kv, D] / [pages, H_kv, page_size, D]. **The LSE is
base 2** here (log2 of the softmax denominator, FlashInfer's choice), unlike ``flash_attn_*``'s
natural log.

Covered: ``BatchDecodeWithPagedKVCacheWrapper``, ``BatchPrefillWithPagedKVCacheWrapper`` and
``BatchPrefillWithRaggedKVCacheWrapper`` (plan/run, CUDA-graph safe with ``use_cuda_graph=True``), ``single_decode_with_kv_cache``, ``single_prefill_with_kv_cache`` (and
``single_prefill_with_kv_cache_return_lse``),
``append_paged_kv_cache``, ``get_batch_indices_positions``, ``get_seq_lens``.
``pos_encoding_mode`` 'NONE' and 'ROPE_LLAMA' (RoPE on q and k inside the paged kernels; the
ragged and single-request calls rotate copies first). Custom masks (``custom_mask`` /
``packed_custom_mask``, FlashInfer's layout: each request's [qo_len, kv_len] booleans flattened,
True = attend, replacing causal) run in the paged prefill kernel; the ragged and single-request
calls then read their K/V rows as pages of one token. ``packbits`` / ``segment_packbits`` are here
too, and cascade attention: ``MultiLevelCascadeAttentionWrapper`` and the merges of attention
states by their (base-2) LSE, ``merge_state``, ``merge_state_in_place``, ``merge_states``
(``ioattn.decode.merge``).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from ioattn.dispatch import sm_count, triton_unavailable_reason
from ioattn.decode.merge import merge_state, merge_state_in_place, merge_states  # noqa: F401
from ioattn.decode import triton_decode
from ioattn.decode.triton_decode import kvcache_attn, paged_attn, paged_tiles
from ioattn.launch import launcher
from ioattn.paged.plan import kv_lengths, max_work_items, split_work, split_work_balanced

_LAYOUTS = ("NHD", "HND")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, torch.float16: torch.float16,
           torch.bfloat16: torch.bfloat16}
# KV caches may also be fp8 (FlashInfer's kv_data_type): K/V are upcast to q's dtype as they are
# loaded; k_scale / v_scale (run()) dequantize
_FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "e4m3": torch.float8_e4m3fn,
        torch.float8_e4m3fn: torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
        "e5m2": torch.float8_e5m2, torch.float8_e5m2: torch.float8_e5m2}


def _kv_dtype(kv_data_type, q_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype a plan accepts: q's (fp16/bf16) or fp8 e4m3 / e5m2."""
    if kv_data_type is None:
        return q_dtype
    dt = _DTYPES.get(kv_data_type) or _FP8.get(kv_data_type)
    if dt is None or (dt in (torch.float16, torch.bfloat16) and dt != q_dtype):
        _fail(f"kv_data_type={kv_data_type!r} must be q's dtype ({q_dtype}) or "
              f"torch.float8_e4m3fn / torch.float8_e5m2", TypeError)
    return dt


def _fail(msg: str, exc=ValueError):
    raise exc(msg)


def _rope_args(mode: str, rope_scale: Optional[float], rope_theta: Optional[float]
               ) -> Optional[tuple[float, float]]:
    """(rope_scale, rope_theta) for ``pos_encoding_mode='ROPE_LLAMA'`` (RoPE applied to q and k
    inside attention, halves layout; positions: keys 0..kv_len-1, queries the last qo_len), None
    for 'NONE'."""
    if mode == "NONE":
        return None
    if mode == "ROPE_LLAMA":
        scale, theta = float(rope_scale or 1.0), float(rope_theta or 1e4)
        if scale <= 0 or theta <= 1:
            _fail(f"rope_scale ({scale}) must be > 0 and rope_theta ({theta}) > 1")
        return scale, theta
    _fail(f"pos_encoding_mode={mode!r}: ioattn supports 'NONE' and 'ROPE_LLAMA' (for ALiBi use "
          "ioattn.flash_attn_func's alibi_slopes)")


def _llama_rope(x: Tensor, positions: Tensor, rope: tuple[float, float]) -> Tensor:
    """x [n, h, d] rotated at positions [n] (the in-kernel formula, in fp32; for the single-
    request calls, which run the non-paged kernels)."""
    d = x.shape[-1]
    i = torch.arange(d // 2, device=x.device, dtype=torch.float32)
    inv_freq = (1.0 / rope[0]) * torch.exp2(-(2.0 * i / d) * math.log2(rope[1]))
    ang = positions.float()[:, None] * inv_freq[None, :]
    c, s_ = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :d // 2].float(), x[..., d // 2:].float()
    return torch.cat([a * c - b * s_, b * c + a * s_], -1).to(x.dtype)


def _int32_cpu(name: str, t) -> list[int]:
    if not isinstance(t, Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        _fail(f"{name} must be a 1-D int32 tensor", TypeError)
    return t.tolist()


def _check_csr(indptr: Tensor, indices: Tensor, last_page_len: Tensor, page_size: int,
               prefix: str = "") -> tuple[list[int], list[int]]:
    """Validate a CSR page table on the host; returns (indptr, last_page_len) as lists. ``prefix``
    names the arguments as the caller's signature does (e.g. 'paged_kv_')."""
    n_ip, n_idx, n_lp = prefix + "indptr", prefix + "indices", prefix + "last_page_len"
    ip, lp = _int32_cpu(n_ip, indptr), _int32_cpu(n_lp, last_page_len)
    if not isinstance(indices, Tensor) or indices.dtype != torch.int32 or indices.dim() != 1:
        _fail(f"{n_idx} must be a 1-D int32 tensor", TypeError)
    batch = len(ip) - 1
    if batch < 1 or len(lp) != batch:
        _fail(f"{n_ip} ({len(ip)}) must have batch + 1 entries and {n_lp} batch ({len(lp)})")
    if ip[0] != 0 or any(b < a for a, b in zip(ip, ip[1:])) or ip[-1] > indices.numel():
        _fail(f"{n_ip} must start at 0, be non-decreasing and end within {n_idx} "
              f"({indices.numel()} entries), got {ip[:8]}...")
    if not isinstance(page_size, int) or page_size < 1:
        _fail(f"page_size={page_size!r} must be an int >= 1")
    for b in range(batch):
        if ip[b + 1] > ip[b] and not 1 <= lp[b] <= page_size:
            _fail(f"{n_lp}[{b}] = {lp[b]} must be in 1..page_size ({page_size})")
    if indices.numel() and int(indices.min()) < 0:
        _fail(f"{n_idx} must be page numbers >= 0")
    return ip, lp


def _check_out(name: str, t: Optional[Tensor], shape: tuple, dtype: torch.dtype,
               device: torch.device) -> None:
    """A caller-supplied output buffer: the kernels write it as a contiguous ``shape``."""
    if t is None:
        return
    if not isinstance(t, Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype \
            or t.device != device or not t.is_contiguous():
        _fail(f"{name} must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, got "
              f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))} on "
              f"{getattr(t, 'device', '?')}")


def _check_run(q: Tensor, want: tuple, cfg: dict, k: Tensor, kv_layout: str, n_pages_needed: int,
               out: Optional[Tensor], lse: Optional[Tensor], device: torch.device) -> None:
    """run()'s inputs against the plan: q's shape and dtype, the cache's page shape and extent,
    and caller-supplied out / lse buffers."""
    if tuple(q.shape) != want or q.dtype != cfg["dtype"]:
        _fail(f"q must be {cfg['dtype']} of shape {want} (as planned), got {q.dtype} {tuple(q.shape)}")
    if q.device != device:  # (plan() checked that the kernels run on the workspace's device)
        _fail(f"q is on {q.device}; the plan's buffers are on {device}")
    if k.device != q.device:
        _fail(f"the cache is on {k.device}, q on {q.device}: put both on the same device")
    kv_dt = cfg.get("kv_dtype", q.dtype)
    if k.shape[1:] != (cfg["page_size"], cfg["h_k"], cfg["d"]) or k.dtype != kv_dt:
        _fail(f"the cache must hold pages of ({cfg['page_size']}, {cfg['h_k']}, {cfg['d']}) in "
              f"{kv_dt} ({kv_layout}; kv_data_type in plan()), got {tuple(k.shape[1:])} {k.dtype}")
    if n_pages_needed > k.shape[0]:
        _fail(f"the planned page indices reach page {n_pages_needed - 1}; the cache has "
              f"{k.shape[0]} pages")
    _check_out("out", out, want, q.dtype, q.device)
    _check_out("lse", lse, want[:2], torch.float32, q.device)


def _check_device(device: torch.device) -> None:
    """plan(): the kernels must run where the wrapper's buffers are."""
    reason = triton_unavailable_reason(device)
    if reason is not None:
        _fail(f"the workspace is on {device}: {reason}")


def _run_inputs(w, q: Tensor, paged_kv_cache, rows: int, out: Optional[Tensor],
                lse: Optional[Tensor], need_lse: bool, q_scale: Optional[float],
                k_scale: Optional[float]):
    """run()'s shared prologue for the paged wrappers ``w``: inputs checked against the plan,
    outputs allocated when not given. Returns (q, k, v, out, lse or None, softmax scale)."""
    if not w._planned:
        _fail("call plan() before run()", RuntimeError)
    c = w._cfg
    k, v = _kv_views(paged_kv_cache, w._kv_layout)
    want = (rows, c["h"], c["d"])
    _check_run(q, want, c, k, w._kv_layout, w._n_pages_needed, out, lse, w._device)
    if out is None:
        out = torch.empty(want, device=q.device, dtype=q.dtype)
    if lse is None and need_lse:
        lse = torch.empty(want[:2], device=q.device, dtype=torch.float32)
    q = q if q.stride(-1) == 1 else q.contiguous()
    return q, k, v, out, lse, c["scale"] * (q_scale or 1.0) * (k_scale or 1.0)


def _check_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> None:
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        _fail(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 1 <= head_dim <= 256:
        _fail(f"head_dim={head_dim} is not supported (1..256)")


def _kv_views(paged_kv_cache, kv_layout: str) -> tuple[Tensor, Tensor]:
    """k, v as [pages, page_size, H_kv, D] views (HND caches become strided views)."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            _fail("paged_kv_cache as a tuple must be (k_cache, v_cache)")
        k, v = paged_kv_cache
    else:
        if not isinstance(paged_kv_cache, Tensor) or paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            _fail("paged_kv_cache must be [pages, 2, page_size, H_kv, D] (NHD), "
                  "[pages, 2, H_kv, page_size, D] (HND) or a (k, v) tuple", TypeError)
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    for name, t in (("k cache", k), ("v cache", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            _fail(f"{name} must be a 4-D tensor [pages, page_size, H_kv, D] (NHD)", TypeError)
        if t.stride(-1) != 1:
            _fail(f"{name} must have a contiguous last dim")
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        _fail(f"the v cache ({tuple(v.shape)}, {v.dtype}) must match the k cache "
              f"({tuple(k.shape)}, {k.dtype}) on one device")
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def get_seq_lens(kv_indptr: Tensor, kv_last_page_len: Tensor, page_size: int) -> Tensor:
    """Tokens per request of a CSR page table: full pages times page_size plus the last page's."""
    pages = kv_indptr[1:] - kv_indptr[:-1]
    return torch.where(pages > 0, (pages - 1) * page_size + kv_last_page_len, 0).to(torch.int32)


def get_batch_indices_positions(append_indptr: Tensor, seq_lens: Tensor, nnz: int
                                ) -> tuple[Tensor, Tensor]:
    """For appending nnz tokens (request b's are append_indptr[b]:append_indptr[b + 1]) to
    sequences whose lengths *after* the append are seq_lens: each token's request and position."""
    counts = (append_indptr[1:] - append_indptr[:-1]).long()
    batch = torch.repeat_interleave(torch.arange(counts.numel(), device=append_indptr.device),
                                    counts, output_size=nnz)
    first = (seq_lens.long() - counts)[batch]
    positions = first + torch.arange(nnz, device=append_indptr.device) - append_indptr.long()[batch]
    return batch.to(torch.int32), positions.to(torch.int32)


@triton.jit
def _append_paged_kernel(K_NEW, V_NEW, K, V, BATCH, POS, INDICES, INDPTR,
                         stride_nn, stride_nh, stride_kp, stride_ks, stride_kh,
                         stride_vp, stride_vs, stride_vh, page_size, n_pages, n_indices,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    off_h = tl.program_id(1)
    b = tl.load(BATCH + i)
    pos = tl.load(POS + i)
    at = tl.minimum(tl.maximum(tl.load(INDPTR + b) + pos // page_size, 0), n_indices - 1)
    page = tl.load(INDICES + at)
    page = tl.minimum(tl.maximum(page, 0), n_pages - 1).to(tl.int64)
    slot = (pos % page_size).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    h64 = off_h.to(tl.int64)
    src = i.to(tl.int64) * stride_nn + h64 * stride_nh + o_d
    tl.store(K + page * stride_kp + slot * stride_ks + h64 * stride_kh + o_d,
             tl.load(K_NEW + src, mask=m_d), mask=m_d)
    tl.store(V + page * stride_vp + slot * stride_vs + h64 * stride_vh + o_d,
             tl.load(V_NEW + src, mask=m_d), mask=m_d)


def append_paged_kv_cache(append_key: Tensor, append_value: Tensor, batch_indices: Tensor,
                          positions: Tensor, paged_kv_cache, kv_indices: Tensor, kv_indptr: Tensor,
                          kv_last_page_len: Tensor, kv_layout: str = "NHD") -> None:
    """Write nnz new tokens ([nnz, H_kv, D]) into a paged cache in place: token i goes to request
    batch_indices[i] at position positions[i] (``get_batch_indices_positions``)."""
    if kv_layout not in _LAYOUTS:
        _fail(f"kv_layout={kv_layout!r} must be one of {_LAYOUTS}")
    k, v = _kv_views(paged_kv_cache, kv_layout)
    nnz, h_k, d = append_key.shape
    if append_value.shape != append_key.shape or k.shape[2:] != (h_k, d):
        _fail(f"append_key/append_value must be [nnz, {k.shape[2]}, {k.shape[3]}] like the cache, got "
              f"{tuple(append_key.shape)} and {tuple(append_value.shape)}")
    if v.shape != k.shape:
        _fail("the v cache must match the k cache's shape")
    for name, t in (("batch_indices", batch_indices), ("positions", positions),
                    ("kv_indices", kv_indices), ("kv_indptr", kv_indptr)):
        if t.dtype != torch.int32 or t.dim() != 1:
            _fail(f"{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}", TypeError)
    if batch_indices.numel() != nnz or positions.numel() != nnz:
        _fail(f"batch_indices and positions need one entry per appended token ({nnz}), got "
              f"{batch_indices.numel()} and {positions.numel()}")
    if nnz == 0:
        return
    batch_indices, positions, kv_indices, kv_indptr = (
        t.contiguous() for t in (batch_indices, positions, kv_indices, kv_indptr))
    if not (batch_indices.is_cuda and torch.cuda.is_current_stream_capturing()):
        # each token must land inside its request's pages (a host sync; skipped under capture,
        # where the kernel still never leaves the cache)
        ip = kv_indptr.tolist()
        bi, pos = batch_indices.tolist(), positions.tolist()
        for i, (b, p_) in enumerate(zip(bi, pos)):
            if not 0 <= b < len(ip) - 1 or not 0 <= p_ < (ip[b + 1] - ip[b]) * k.shape[1]:
                _fail(f"token {i}: request {b}, position {p_} lies outside that request's pages "
                      "(kv_indptr); allocate the pages before appending")
    append_key, append_value = append_key.contiguous(), append_value.contiguous()  # one layout
    launcher(_append_paged_kernel)[(nnz, h_k)](
        append_key, append_value, k, v, batch_indices, positions, kv_indices, kv_indptr,
        append_key.stride(0), append_key.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), k.shape[1], k.shape[0], kv_indices.numel(),
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=1)


def single_decode_with_kv_cache(q: Tensor, k: Tensor, v: Tensor, kv_layout: str = "NHD",
                                pos_encoding_mode: str = "NONE", use_tensor_cores: bool = False,
                                q_scale: Optional[float] = None, k_scale: Optional[float] = None,
                                v_scale: Optional[float] = None, window_left: int = -1,
                                logits_soft_cap: Optional[float] = None,
                                sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
                                rope_theta: Optional[float] = None, return_lse: bool = False):
    """One query token q [H, D] over k, v [kv_len, H_kv, D] (NHD) or [H_kv, kv_len, D] (HND).
    Returns out [H, D] (and the base-2 LSE [H] with return_lse)."""
    rope = _rope_args(pos_encoding_mode, rope_scale, rope_theta)
    if kv_layout not in _LAYOUTS:
        _fail(f"kv_layout={kv_layout!r} must be one of {_LAYOUTS}")
    if q.dim() != 2 or k.dim() != 3 or v.shape != k.shape:
        _fail(f"q must be [H, D] and k, v [kv_len, H_kv, D] (NHD) / [H_kv, kv_len, D] (HND); got "
              f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    q = q.contiguous()  # viewed as [1, 1, H, D] below
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    h, d = q.shape
    kv_len, h_k = k.shape[0], k.shape[1]
    if k.shape[2] != d or h % h_k or q.dtype not in (torch.float16, torch.bfloat16) \
            or k.dtype not in (q.dtype, torch.float8_e4m3fn, torch.float8_e5m2) or v.dtype != k.dtype:
        _fail(f"q [H={h}, D={d}] and k [.., H_kv={h_k}, D={k.shape[2]}] need equal D, H % H_kv == 0, "
              f"q fp16/bf16 and k, v in q's dtype or fp8 (e4m3 / e5m2, with k_scale / v_scale)")
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)) * (q_scale or 1.0) * (k_scale or 1.0)
    if rope is not None:
        k = _llama_rope(k, torch.arange(kv_len, device=q.device), rope)
        q = _llama_rope(q[None], torch.full((1,), kv_len - 1, device=q.device), rope)[0]
    out = torch.empty(1, 1, h, d, device=q.device, dtype=q.dtype)
    lse = torch.empty(1, h, 1, device=q.device, dtype=torch.float32)
    lens = torch.full((1,), kv_len, dtype=torch.int32, device=q.device)
    kvcache_attn(q.view(1, 1, h, d), k[None], v[None], lens, None, None, None, None, scale,
                 window_left, -1, float(logits_soft_cap or 0.0), 0, out, lse)
    o = out.view(h, d) * v_scale if v_scale is not None else out.view(h, d)
    return (o, lse.view(h) * (1.0 / math.log(2.0))) if return_lse else o


class BatchDecodeWithPagedKVCacheWrapper:
    """Decode (one query token per request) over a paged KV cache, FlashInfer's wrapper.

    plan() runs on the host once per step (shared by every layer): it reads the CSR page table,
    splits long requests into KV chunks so the SMs are busy, and writes the work list into
    buffers. run() launches the kernels on those buffers and allocates nothing but ``out``/``lse``
    when they are not passed; with ``use_cuda_graph=True`` the buffers keep their size and address,
    so a graph captured around run() replays under later plans with new lengths.
    GQA: the query heads of one KV head share a tile (tensor cores), whatever use_tensor_cores says.
    """

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: Optional[Tensor] = None,
                 paged_kv_indices_buffer: Optional[Tensor] = None,
                 paged_kv_last_page_len_buffer: Optional[Tensor] = None,
                 backend: str = "auto", jit_args=None) -> None:
        if kv_layout not in _LAYOUTS:
            _fail(f"kv_layout={kv_layout!r} must be one of {_LAYOUTS}")
        if not isinstance(float_workspace_buffer, Tensor):
            _fail("float_workspace_buffer must be a torch.Tensor (e.g. 128 MB of uint8)", TypeError)
        if backend not in ("auto", "triton"):
            _fail(f"backend={backend!r}: ioattn's paged decode is the portable Triton kernel "
                  "('auto' or 'triton')")
        if use_cuda_graph and paged_kv_indices_buffer is None:
            _fail("use_cuda_graph=True needs paged_kv_indices_buffer (int32, as many entries as "
                  "the largest plan's indices): a captured run() reads the page indices from a "
                  "buffer whose address cannot change")
        if paged_kv_indices_buffer is not None and (
                not isinstance(paged_kv_indices_buffer, Tensor)
                or paged_kv_indices_buffer.dtype != torch.int32 or paged_kv_indices_buffer.dim() != 1
                or paged_kv_indices_buffer.device != float_workspace_buffer.device):
            _fail(f"paged_kv_indices_buffer must be a 1-D int32 tensor on "
                  f"{float_workspace_buffer.device} (the workspace's device)", TypeError)
        self._workspace = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._indices_buf = paged_kv_indices_buffer
        self._batch: Optional[int] = None
        self._max_items = 0
        self._planned = False

    def reset_workspace_buffer(self, float_workspace_buffer: Tensor, int_workspace_buffer=None) -> None:
        self._workspace = float_workspace_buffer

    def plan(self, indptr: Tensor, indices: Tensor, last_page_len: Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: Optional[float] = None,
             q_data_type: Union[str, torch.dtype] = "float16",
             kv_data_type: Union[str, torch.dtype, None] = None,
             data_type: Union[str, torch.dtype, None] = None, sm_scale: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
             non_blocking: bool = True, fixed_split_size: Optional[int] = None,
             disable_split_kv: bool = False, **_unused) -> None:
        """Validate the page table on the host and build this step's work list (see class doc)."""
        rope = _rope_args(pos_encoding_mode, rope_scale, rope_theta)
        ip, lp = _check_csr(indptr, indices, last_page_len, page_size)
        idx = indices
        batch = len(ip) - 1
        _check_heads(num_qo_heads, num_kv_heads, head_dim)
        _check_device(self._device)
        name, value = ("q_data_type", q_data_type) if data_type is None else ("data_type", data_type)
        dt = _DTYPES.get(value)
        if dt is None:
            _fail(f"{name}={value!r} must be float16 or bfloat16", TypeError)
        kv_dt = _kv_dtype(kv_data_type, dt)
        if rope is not None and head_dim % 2:
            _fail(f"pos_encoding_mode='ROPE_LLAMA' needs an even head_dim, got {head_dim}")
        if self._use_cuda_graph and self._batch is not None and batch != self._batch:
            _fail(f"use_cuda_graph=True fixes the batch size at the first plan ({self._batch}); "
                  f"got {batch}")
        kv_heads0 = getattr(self, "_plan_kv_heads", None)
        if self._use_cuda_graph and kv_heads0 is not None and num_kv_heads != kv_heads0:
            # (checked before any buffer is replaced: a captured graph keeps reading them)
            _fail(f"use_cuda_graph=True fixes the KV head count at the first plan ({kv_heads0}); "
                  f"got {num_kv_heads}")
        lengths = kv_lengths(ip, lp, page_size)
        sms = sm_count(self._device)
        max_items = max_work_items(batch, num_kv_heads, sms)
        # (opt-in, ``triton_decode.SM90_DECODE_BALANCED``) FlashInfer's balanced split, unless
        # the caller fixes the split
        balanced = (triton_decode.SM90_DECODE_BALANCED and not disable_split_kv
                    and fixed_split_size is None)
        if self._use_cuda_graph and getattr(self, "_balanced", balanced) != balanced:
            # (before any buffer is replaced)
            _fail("use_cuda_graph=True fixes the split mode at the first plan (fixed_split_size "
                  "/ disable_split_kv given or not)")
        plan = split_work_balanced(lengths, num_kv_heads, sms) if balanced else split_work(
            lengths, num_kv_heads, sms,
            fixed_chunk=max(lengths + [1]) if disable_split_kv else fixed_split_size)
        if len(plan.work) > max_items:
            if self._use_cuda_graph:
                _fail(f"fixed_split_size={fixed_split_size} gives {len(plan.work)} work items, more "
                      f"than the {max_items} a captured graph launches; use a larger split size")
            max_items = len(plan.work)
        # device buffers: allocated at the first plan (or when they must grow), reused after
        if self._batch is None or max_items > self._max_items or batch != self._batch:
            dev = self._device
            self._work = torch.zeros(max_items, 5, dtype=torch.int32, device=dev)
            self._n_work = torch.zeros(1, dtype=torch.int32, device=dev)
            self._seqlens_indptr = torch.zeros(3 * batch + 2, dtype=torch.int32, device=dev)
            self._slot_start = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
            self._max_items = max_items
        cols = getattr(self, "_columns", None)
        if balanced and (cols is None or cols.numel() != len(plan.columns)):
            # (the column count depends on the SMs and KV heads only, fixed under graphs)
            self._columns = torch.zeros(len(plan.columns), dtype=torch.int32, device=self._device)
        if getattr(self, "_counts", None) is None or self._counts.numel() < batch * num_kv_heads:
            # the sm90 decode's in-kernel merge tickets (zero between launches; graph mode
            # fixes batch and KV heads at the first plan, above)
            self._counts = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=self._device)
        if self._use_cuda_graph:
            # the sm90 decode's unit claims on a graph's bound grid: zero between launches (the
            # last claimant zeroes them; zeroed here too, outside any graph, so that a launch
            # that did not finish cannot leave later ones skipping units)
            if getattr(self, "_claims", None) is None:
                self._claims = torch.zeros(triton_decode.CLAIM_WORDS, dtype=torch.int32,
                                           device=self._device)
            self._claims.zero_()
        if getattr(self, "_lse_keep", None) is None or self._lse_keep.shape != (batch, num_qo_heads):
            # where run() writes the LSE when the caller does not want it
            self._lse_keep = torch.empty(batch, num_qo_heads, device=self._device, dtype=torch.float32)
            self._batch = batch
        need = self._max_items * num_qo_heads * (head_dim + 1) * 4
        if self._workspace.numel() * self._workspace.element_size() < need:
            _fail(f"float_workspace_buffer holds {self._workspace.numel() * self._workspace.element_size()}"
                  f" bytes; this plan needs {need} (allocate a larger one, e.g. 128 MB)")
        flat = self._workspace.view(torch.uint8)[:need].view(torch.float32)
        n_rows = self._max_items * num_qo_heads
        self._o_part = flat[:n_rows * head_dim].view(self._max_items, num_qo_heads, head_dim)
        self._lse_part = flat[n_rows * head_dim:n_rows * (head_dim + 1)].view(self._max_items, num_qo_heads)
        work = torch.tensor(plan.work, dtype=torch.int32).view(-1, 5)
        self._work[:work.shape[0]].copy_(work, non_blocking=non_blocking)
        # (a copy, not a fill kernel: the sm90 decode's claiming CTAs read it before PDL's wait)
        self._n_work.copy_(torch.tensor([len(plan.work)], dtype=torch.int32), non_blocking=non_blocking)
        self._n_items = len(plan.work)
        self._seqlens_indptr.copy_(torch.tensor(lengths + ip + list(range(batch + 1)), dtype=torch.int32),
                                   non_blocking=non_blocking)
        self._slot_start.copy_(torch.tensor(plan.slot_start, dtype=torch.int32), non_blocking=non_blocking)
        if balanced:
            self._columns.copy_(torch.tensor(plan.columns, dtype=torch.int32),
                                non_blocking=non_blocking)
        # no request split: run() skips the merge launch, unless a captured graph must keep it
        # for later plans
        self._merge = self._use_cuda_graph or plan.slot_start[-1] > 0
        if self._indices_buf is not None:
            if self._indices_buf.numel() < idx.numel():
                _fail(f"paged_kv_indices_buffer has {self._indices_buf.numel()} entries; this plan "
                      f"needs {idx.numel()}")
            self._indices_buf[:idx.numel()].copy_(idx, non_blocking=non_blocking)
            self._indices = self._indices_buf
        else:
            # a buffer of the wrapper's own, grown geometrically (the kernels take its size as a
            # bound, as a graph-mode caller's larger buffer), so that its address stays from
            # plan to plan: run()'s kept sm90 launches (``sm90_decode._BOUND``) key on it
            own = getattr(self, "_indices_own", None)
            if own is None or own.numel() < idx.numel():
                size = max(idx.numel(), 2 * own.numel() if own is not None else 0, 1024)
                own = self._indices_own = torch.zeros(size, dtype=torch.int32, device=self._device)
            own[:idx.numel()].copy_(idx, non_blocking=non_blocking)
            self._indices = own
        self._n_pages_needed = int(idx.max()) + 1 if idx.numel() else 0  # (min >= 0: _check_csr)
        self._cfg = dict(h=num_qo_heads, h_k=num_kv_heads, d=head_dim, page_size=page_size,
                         window_left=window_left, softcap=float(logits_soft_cap or 0.0),
                         scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
                         dtype=dt, kv_dtype=kv_dt, rope=rope,
                         block_m=paged_tiles(num_qo_heads // num_kv_heads, head_dim)[0])
        self._balanced = balanced  # (run() launches over the columns)
        self._plan_kv_heads = num_kv_heads
        self._planned = True

    def run(self, q: Tensor, paged_kv_cache, *args, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            out: Optional[Tensor] = None, lse: Optional[Tensor] = None, return_lse: bool = False,
            enable_pdl=None, window_left: Optional[int] = None, **_unused):
        """Attention of q [batch, num_qo_heads, head_dim] over the planned pages. Returns out
        [batch, num_qo_heads, head_dim] (and the base-2 LSE [batch, num_qo_heads]).
        enable_pdl: launch the sm90 decode kernel with programmatic dependent launch (True /
        False; None: ``IOATTN_SM90_DECODE_PDL``, on by default, as FlashInfer's None turns it on
        for Hopper); the portable kernel ignores it."""
        q, k, v, out, lse, scale = _run_inputs(self, q, paged_kv_cache, self._batch, out, lse,
                                               return_lse, q_scale, k_scale)
        c = self._cfg
        wl = c["window_left"] if window_left is None else window_left
        block_m = c["block_m"]
        # the grid: the plan's own items, or the bound every later plan fits in when a graph
        # may replay this launch (use_cuda_graph, or a capture under way). A graph-mode
        # wrapper's CTAs claim their work SM by SM (``sm90_decode.CLAIM``): on the bound's grid
        # the block scheduler doubles the first CTAs up on some SMs (16 x 8k unsplit, 128 CTAs,
        # ran 3.54 TB/s on 49 items x 8 heads against 3.91 on 16 x 8;
        # results/tune/tune_sm90_decode_grid_9af71c4_*). (Not under a capture of an eager
        # wrapper: the kernel that claims is another compile, which a capture cannot load.)
        graph = self._use_cuda_graph or (q.is_cuda and torch.cuda.is_current_stream_capturing())
        paged_attn(q, k, v, self._indices, self._seqlens_indptr, self._work, self._n_work,
                   self._slot_start if self._merge else None,
                   self._max_items if graph else self._n_items,
                   -(-(c["h"] // c["h_k"]) // block_m), block_m,
                   self._o_part, self._lse_part, scale, wl, -1, c["softcap"], out,
                   lse if lse is not None else self._lse_keep, lse_base2=True, rope=c["rope"],
                   decode=True, counts=self._counts,
                   columns=self._columns if self._balanced else None, pdl=enable_pdl,
                   claims=self._claims if self._use_cuda_graph else None)
        if v_scale is not None:
            out.mul_(v_scale)
        return (out, lse) if return_lse else out

    forward = run
    begin_forward = plan


def _prefill_window(causal: bool, window_left: int) -> tuple[int, int]:
    return (window_left if window_left is not None else -1), (0 if causal else -1)


def packbits(x: Tensor, bitorder: str = "little") -> Tensor:
    """FlashInfer's ``packbits``: the flattened booleans of ``x``, 8 per uint8 (the last byte
    zero-padded); 'little': element 8i + j is bit j of byte i."""
    if bitorder not in ("little", "big"):
        _fail(f"bitorder={bitorder!r} must be 'little' or 'big'")
    bits = (x.reshape(-1) != 0).to(torch.uint8)
    bits = torch.cat([bits, bits.new_zeros((-bits.numel()) % 8)]).view(-1, 8)
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    if bitorder == "big":
        shifts = shifts.flip(0)
    return (bits << shifts).sum(1, dtype=torch.uint8)


def segment_packbits(x: Tensor, indptr: Tensor, bitorder: str = "little") -> tuple[Tensor, Tensor]:
    """FlashInfer's ``segment_packbits``: each segment x[indptr[i]:indptr[i + 1]] packed on its own
    (starting at a byte); returns (packed uint8, new_indptr int32 of byte offsets)."""
    ip = _int32_cpu("indptr", indptr)
    parts = [packbits(x[a:b], bitorder) for a, b in zip(ip, ip[1:])]
    sizes = [0] + [t.numel() for t in parts]
    new_ip = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    packed = torch.cat(parts) if parts else x.new_zeros(0, dtype=torch.uint8)
    return packed, new_ip.to(indptr.device)


def _custom_mask(custom_mask, packed_custom_mask, qo_lens: list[int], kv_lens: list[int],
                 device: torch.device) -> Optional[tuple[Tensor, Tensor]]:
    """plan()'s custom mask as the kernels read it: (little-endian packed bits on ``device``,
    int32 byte offset of each request's [qo_len, kv_len] block). None without a mask."""
    if custom_mask is None and packed_custom_mask is None:
        return None
    sizes = [q * k for q, k in zip(qo_lens, kv_lens)]
    if packed_custom_mask is None:
        if not isinstance(custom_mask, Tensor) or custom_mask.dtype != torch.bool:
            _fail("custom_mask must be a bool tensor (each request's [qo_len, kv_len] mask, "
                  "flattened and concatenated; True = attend)", TypeError)
        if custom_mask.numel() != sum(sizes):
            _fail(f"custom_mask has {custom_mask.numel()} entries; the plan's requests need "
                  f"sum(qo_len * kv_len) = {sum(sizes)}")
        indptr = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
        packed, byte_ip = segment_packbits(custom_mask.reshape(-1), indptr)
    else:
        if not isinstance(packed_custom_mask, Tensor) or packed_custom_mask.dtype != torch.uint8 \
                or packed_custom_mask.dim() != 1:
            _fail("packed_custom_mask must be a 1-D uint8 tensor (segment_packbits of the mask, "
                  "bitorder='little')", TypeError)
        nbytes = [-(-n // 8) for n in sizes]
        if packed_custom_mask.numel() != sum(nbytes):
            _fail(f"packed_custom_mask has {packed_custom_mask.numel()} bytes; the plan's requests "
                  f"need sum(ceil(qo_len * kv_len / 8)) = {sum(nbytes)} (segment_packbits)")
        packed = packed_custom_mask
        byte_ip = torch.tensor([0] + nbytes, dtype=torch.int64).cumsum(0).to(torch.int32)
    if int(byte_ip[-1]) >= 2 ** 31 - 1:
        _fail("the custom mask exceeds 2^31 bytes")
    return packed.to(device).contiguous(), byte_ip.to(device)


def _single_request_table(kv_len: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """A page table of one request whose kv_len rows are pages of one token (page_size 1):
    how contiguous K/V reach the paged kernels."""
    return (torch.tensor([0, kv_len], dtype=torch.int32),
            torch.arange(kv_len, dtype=torch.int32, device=device),
            torch.tensor([1 if kv_len else 0], dtype=torch.int32))


def _base2(lse_natural_h_t: Tensor) -> Tensor:
    """[h, total] natural-log LSE (the dense kernels') as FlashInfer's [total, h] base 2."""
    return (lse_natural_h_t * (1.0 / math.log(2.0))).t().contiguous()


def single_prefill_with_kv_cache(q: Tensor, k: Tensor, v: Tensor, custom_mask=None,
                                 packed_custom_mask=None, causal: bool = False,
                                 kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                 use_fp16_qk_reduction: bool = False,
                                 sm_scale: Optional[float] = None, window_left: int = -1,
                                 logits_soft_cap: Optional[float] = None,
                                 rope_scale: Optional[float] = None,
                                 rope_theta: Optional[float] = None, return_lse: bool = False):
    """q [qo_len, H, D] over k, v [kv_len, H_kv, D] (NHD) / [H_kv, kv_len, D] (HND); causal is
    aligned bottom-right (the queries are the last qo_len positions). custom_mask: bool
    [qo_len, kv_len] (True = attend; replaces causal), or packed_custom_mask (``packbits`` of it,
    little-endian). Returns out [qo_len, H, D] (and the base-2 LSE [qo_len, H])."""
    from ioattn.dense.api import flash_attn_func

    rope = _rope_args(pos_encoding_mode, rope_scale, rope_theta)
    if kv_layout not in _LAYOUTS:
        _fail(f"kv_layout={kv_layout!r} must be one of {_LAYOUTS}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        _fail("q must be [qo_len, H, D] and k, v [kv_len, H_kv, D] (NHD) or [H_kv, kv_len, D] (HND)")
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    if custom_mask is not None or packed_custom_mask is not None:
        # the masked paged kernel over K/V rows as pages of one token
        w = BatchPrefillWithPagedKVCacheWrapper(q.new_empty(0))
        w.plan(torch.tensor([0, q.shape[0]], dtype=torch.int32),
               *_single_request_table(k.shape[0], q.device), q.shape[1], k.shape[1], q.shape[2], 1,
               custom_mask=None if custom_mask is None else custom_mask.reshape(-1),
               packed_custom_mask=packed_custom_mask, pos_encoding_mode=pos_encoding_mode,
               sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
               rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q.dtype)
        return w.run(q, (k[:, None], v[:, None]), return_lse=return_lse)
    if rope is not None:
        kv_len, qo_len = k.shape[0], q.shape[0]
        k = _llama_rope(k, torch.arange(kv_len, device=q.device), rope)
        q = _llama_rope(q, torch.arange(kv_len - qo_len, kv_len, device=q.device), rope)
    out, lse, _ = flash_attn_func(q[None], k[None], v[None], softmax_scale=sm_scale, causal=causal,
                                  window_size=_prefill_window(False, window_left),
                                  softcap=float(logits_soft_cap or 0.0), return_attn_probs=True)
    return (out[0], _base2(lse[0])) if return_lse else out[0]


def single_prefill_with_kv_cache_return_lse(q: Tensor, k: Tensor, v: Tensor, **kwargs):
    """``single_prefill_with_kv_cache(..., return_lse=True)``: (out, base-2 LSE [qo_len, H]),
    FlashInfer's name for it."""
    return single_prefill_with_kv_cache(q, k, v, return_lse=True, **kwargs)


class BatchPrefillWithRaggedKVCacheWrapper:
    """Prefill over ragged (packed) K/V: request b's queries are q[qo_indptr[b]:qo_indptr[b + 1]]
    and its keys k[kv_indptr[b]:kv_indptr[b + 1]]. plan() reads the indptrs once per step; run()
    launches the dense varlen kernels (the sm90 Gluon forward on Hopper where it applies)."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf=None, kv_indptr_buf=None,
                 custom_mask_buf: Optional[Tensor] = None, mask_indptr_buf: Optional[Tensor] = None,
                 backend: str = "auto", **_unused) -> None:
        """With ``use_cuda_graph=True`` a graph captured around run() replays under later plans
        of the same batch size and query / key counts (q's and k's shapes are in the graph):
        plan() writes the indptrs into fixed device buffers, and the kernels' grid covers any
        split of those counts (each request's longest possible length is the total). Custom
        masks there need custom_mask_buf and mask_indptr_buf."""
        if kv_layout != "NHD":
            _fail("ragged K/V are [total_kv, H_kv, D] (kv_layout='NHD')")
        self._backend = backend
        self._device = float_workspace_buffer.device
        self._use_cuda_graph = use_cuda_graph
        self._mask_bufs = dict(custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf)
        self._fixed: Optional[tuple[int, int, int]] = None  # graph mode: (batch, total_q, total_kv)
        self._planned = False

    def plan(self, qo_indptr: Tensor, kv_indptr: Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, head_dim_vo: Optional[int] = None, custom_mask=None,
             packed_custom_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, window_left: int = -1,
             logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
             q_data_type: Union[str, torch.dtype] = "float16", kv_data_type=None,
             non_blocking: bool = True, **_unused) -> None:
        rope = _rope_args(pos_encoding_mode, rope_scale, rope_theta)
        if rope is not None and head_dim_qk % 2:
            _fail(f"pos_encoding_mode='ROPE_LLAMA' needs an even head_dim_qk, got {head_dim_qk}")
        qi, ki = _int32_cpu("qo_indptr", qo_indptr), _int32_cpu("kv_indptr", kv_indptr)
        if len(qi) != len(ki) or len(qi) < 2:
            _fail(f"qo_indptr ({len(qi)}) and kv_indptr ({len(ki)}) need batch + 1 entries each")
        for name, ip in (("qo_indptr", qi), ("kv_indptr", ki)):
            if ip[0] != 0 or any(b < a for a, b in zip(ip, ip[1:])):
                _fail(f"{name} must start at 0 and be non-decreasing, got {ip[:8]}...")
        _check_heads(num_qo_heads, num_kv_heads, head_dim_qk)
        shape = (len(qi) - 1, qi[-1], ki[-1])
        graph = self._use_cuda_graph
        if graph and self._fixed is not None and shape != self._fixed:
            _fail(f"use_cuda_graph=True fixes (batch, query count, key count) at the first plan "
                  f"{self._fixed}; got {shape}")
        first = self._fixed is None or not graph
        self._fixed = shape
        dev = self._device
        self._masked = None
        if custom_mask is not None or packed_custom_mask is not None:
            # the masked paged kernel, over the ragged K/V rows as pages of one token
            if first or getattr(self, "_inner", None) is None:
                self._inner = BatchPrefillWithPagedKVCacheWrapper(
                    torch.empty(0, device=dev), use_cuda_graph=graph,
                    paged_kv_indices_buf=torch.arange(ki[-1], dtype=torch.int32, device=dev),
                    **self._mask_bufs)
            self._masked = self._inner
            self._masked.plan(
                qo_indptr, kv_indptr, torch.arange(ki[-1], dtype=torch.int32),
                torch.tensor([min(1, b - a) for a, b in zip(ki, ki[1:])], dtype=torch.int32),
                num_qo_heads, num_kv_heads, head_dim_qk, 1, head_dim_vo, custom_mask=custom_mask,
                packed_custom_mask=packed_custom_mask, pos_encoding_mode=pos_encoding_mode,
                sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type)
            self._planned = True
            return
        if first:
            self._cu_q = torch.empty(len(qi), dtype=torch.int32, device=dev)
            self._cu_k = torch.empty(len(ki), dtype=torch.int32, device=dev)
        self._cu_q.copy_(torch.tensor(qi, dtype=torch.int32), non_blocking=non_blocking)
        self._cu_k.copy_(torch.tensor(ki, dtype=torch.int32), non_blocking=non_blocking)
        if graph:  # bounds that hold for every later plan of the same counts
            self._max_q, self._max_k = max(qi[-1], 1), max(ki[-1], 1)
        else:
            self._max_q = max(b - a for a, b in zip(qi, qi[1:]))
            self._max_k = max(b - a for a, b in zip(ki, ki[1:]))
        self._totals = (qi[-1], ki[-1])
        self._cfg = dict(h=num_qo_heads, h_k=num_kv_heads, causal=causal, window_left=window_left,
                         softcap=float(logits_soft_cap or 0.0), scale=sm_scale, rope=rope)
        if rope is not None:
            # RoPE positions per token: keys 0..kv_len-1, queries the last qo_len of them
            kv_lens = [b - a for a, b in zip(ki, ki[1:])]
            q_pos = [kv_lens[r] - (qi[r + 1] - qi[r]) + t for r in range(len(qi) - 1)
                     for t in range(qi[r + 1] - qi[r])]
            k_pos = [t for n in kv_lens for t in range(n)]
            if first or getattr(self, "_rope_pos", None) is None:
                self._rope_pos = (torch.empty(len(q_pos), dtype=torch.int32, device=dev),
                                  torch.empty(len(k_pos), dtype=torch.int32, device=dev))
            for buf, pos in zip(self._rope_pos, (q_pos, k_pos)):
                buf.copy_(torch.tensor(pos, dtype=torch.int32), non_blocking=non_blocking)
        self._planned = True

    def run(self, q: Tensor, k: Tensor, v: Tensor, *args, out: Optional[Tensor] = None,
            lse: Optional[Tensor] = None, return_lse: bool = False, **_unused):
        """q [total_q, H, D], k/v [total_kv, H_kv, D] -> out [total_q, H, D] (and base-2 LSE
        [total_q, H])."""
        from ioattn.dense.api import flash_attn_varlen_func

        if not self._planned:
            _fail("call plan() before run()", RuntimeError)
        if self._masked is not None:
            if k.dim() != 3 or v.dim() != 3:
                _fail("k and v must be [total_kv, H_kv, D]")
            return self._masked.run(q, (k[:, None], v[:, None]), out=out, lse=lse,
                                    return_lse=return_lse)
        c = self._cfg
        dev = q.device
        if q.shape[0] < self._totals[0] or k.shape[0] < self._totals[1]:
            _fail(f"q/k hold {q.shape[0]}/{k.shape[0]} rows; the plan's indptrs need "
                  f"{self._totals[0]}/{self._totals[1]}")
        if c["rope"] is not None:  # rotated copies (the dense kernels take rotated inputs)
            q_pos, k_pos = self._rope_pos
            q = torch.cat([_llama_rope(q[:self._totals[0]], q_pos, c["rope"]), q[self._totals[0]:]])
            k = torch.cat([_llama_rope(k[:self._totals[1]], k_pos, c["rope"]), k[self._totals[1]:]])
        o, l_, _ = flash_attn_varlen_func(
            q, k, v, self._cu_q, self._cu_k, self._max_q, self._max_k,
            softmax_scale=c["scale"], causal=c["causal"],
            window_size=_prefill_window(False, c["window_left"]), softcap=c["softcap"],
            return_attn_probs=True, backend=self._backend)
        if out is not None:
            _check_out("out", out, tuple(o.shape), o.dtype, o.device)
            out.copy_(o)
            o = out
        if return_lse:
            l2 = _base2(l_)
            if lse is not None:
                _check_out("lse", lse, tuple(l2.shape), torch.float32, l2.device)
                lse.copy_(l2)
                l2 = lse
            return o, l2
        return o

    forward = run
    begin_forward = plan


class BatchPrefillWithPagedKVCacheWrapper:
    """Prefill (several query tokens per request, e.g. chunked prefill or verification) over a
    paged KV cache. Queries are ragged (qo_indptr); the CSR page table as the decode wrapper's.
    Causal is aligned bottom-right: request b's queries are its last qo_len positions."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf=None, paged_kv_indptr_buf=None,
                 paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf: Optional[Tensor] = None, mask_indptr_buf: Optional[Tensor] = None,
                 backend: str = "auto", **_unused) -> None:
        """With ``use_cuda_graph=True`` a graph captured around run() replays under later plans
        of the same batch size and query count (q's shape is part of the graph); plan() writes
        into buffers whose addresses stay: paged_kv_indices_buf (required) and, for custom
        masks, custom_mask_buf (uint8) and mask_indptr_buf (int32, batch + 1)."""
        if kv_layout not in _LAYOUTS:
            _fail(f"kv_layout={kv_layout!r} must be one of {_LAYOUTS}")
        if use_cuda_graph and paged_kv_indices_buf is None:
            _fail("use_cuda_graph=True needs paged_kv_indices_buf (int32, as many entries as the "
                  "largest plan's indices): a captured run() reads the page indices from a buffer "
                  "whose address cannot change")
        if backend not in ("auto", "triton"):
            _fail(f"backend={backend!r}: ioattn's paged prefill is the portable Triton kernel")
        self._device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._bufs = dict(indices=paged_kv_indices_buf, mask=custom_mask_buf,
                          mask_indptr=mask_indptr_buf)
        self._fixed: Optional[tuple] = None  # graph mode: (batch, total_q, block_m) of the first plan
        self._planned = False

    def plan(self, qo_indptr: Tensor, paged_kv_indptr: Tensor, paged_kv_indices: Tensor,
             paged_kv_last_page_len: Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, page_size: int, head_dim_vo: Optional[int] = None,
             custom_mask=None, packed_custom_mask=None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: Optional[float] = None, window_left: int = -1,
             logits_soft_cap: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, q_data_type: Union[str, torch.dtype] = "float16",
             kv_data_type=None, non_blocking: bool = True, **_unused) -> None:
        rope = _rope_args(pos_encoding_mode, rope_scale, rope_theta)
        if head_dim_vo not in (None, head_dim_qk):
            _fail("head_dim_vo must equal head_dim_qk for paged caches")
        ip, lp = _check_csr(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size,
                            "paged_kv_")
        qi = _int32_cpu("qo_indptr", qo_indptr)
        batch = len(ip) - 1
        if len(qi) != batch + 1 or qi[0] != 0 or any(b < a for a, b in zip(qi, qi[1:])):
            _fail(f"qo_indptr must have batch + 1 = {batch + 1} non-decreasing entries from 0")
        _check_heads(num_qo_heads, num_kv_heads, head_dim_qk)
        _check_device(self._device)
        if rope is not None and head_dim_qk % 2:
            _fail(f"pos_encoding_mode='ROPE_LLAMA' needs an even head_dim_qk, got {head_dim_qk}")
        dt = _DTYPES.get(q_data_type)
        if dt is None:
            _fail(f"q_data_type={q_data_type!r} must be float16 or bfloat16", TypeError)
        kv_dt = _kv_dtype(kv_data_type, dt)
        lengths = kv_lengths(ip, lp, page_size)
        qo_lens = [b - a for a, b in zip(qi, qi[1:])]
        if causal and custom_mask is None and packed_custom_mask is None \
                and any(n > m for n, m in zip(qo_lens, lengths)):
            # (without a causal mask, e.g. a cascade level of keys that precede every query,
            # any count is fine: a request with no keys gives out 0 and LSE -inf)
            _fail("with causal=True each request's query count must not exceed its KV length (the "
                  f"queries are the last positions of the sequence); got qo {qo_lens[:8]} vs kv "
                  f"{lengths[:8]}")
        dev = self._device
        # a custom mask replaces causal (FlashInfer's rule); window_left still applies
        mask = _custom_mask(custom_mask, packed_custom_mask, qo_lens, lengths, dev)
        causal = causal and mask is None
        group = num_qo_heads // num_kv_heads
        graph = self._use_cuda_graph
        if graph and self._fixed is not None and (batch, qi[-1]) != self._fixed[:2]:
            _fail(f"use_cuda_graph=True fixes the batch size and the query count at the first plan "
                  f"{self._fixed[:2]}; got {(batch, qi[-1])}")
        # graph mode: one tile shape for any split of the fixed query count
        rows = qi[-1] if graph else max(qo_lens + [1])
        block_m = paged_tiles(group, head_dim_qk, rows_per_request=max(rows, 1),
                              extras=rope is not None or bool(logits_soft_cap) or mask is not None)[0]
        if graph and self._fixed is not None:
            block_m = self._fixed[2]
        work = [(b, m, 0, n, -1) for b, (q_n, n) in enumerate(zip(qo_lens, lengths))
                for m in range(-(-q_n * group // block_m))]
        # every request's row blocks fit: sum ceil(q_n * group / block_m) <= this
        max_items = -(-qi[-1] * group // block_m) + batch if graph else max(len(work), 1)
        if not graph or self._fixed is None:
            self._work = torch.zeros(max_items, 5, dtype=torch.int32, device=dev)
            self._n_work = torch.zeros(1, dtype=torch.int32, device=dev)
            self._seqlens_indptr = torch.zeros(3 * batch + 2, dtype=torch.int32, device=dev)
            self._fixed = (batch, qi[-1], block_m)
        if work:
            self._work[:len(work)].copy_(torch.tensor(work, dtype=torch.int32), non_blocking=non_blocking)
        self._n_work.fill_(len(work))
        self._seqlens_indptr.copy_(torch.tensor(lengths + ip + qi, dtype=torch.int32),
                                   non_blocking=non_blocking)
        self._indices = self._into_buf("indices", paged_kv_indices, "paged_kv_indices_buf", non_blocking)
        self._mask = None
        if mask is not None:
            self._mask = (self._into_buf("mask", mask[0], "custom_mask_buf", non_blocking),
                          self._into_buf("mask_indptr", mask[1], "mask_indptr_buf", non_blocking))
        self._n_pages_needed = int(paged_kv_indices.max()) + 1 if paged_kv_indices.numel() else 0
        self._total_q = qi[-1]
        self._cfg = dict(h=num_qo_heads, h_k=num_kv_heads, d=head_dim_qk, page_size=page_size,
                         causal=causal, window_left=window_left, block_m=block_m, rope=rope,
                         softcap=float(logits_soft_cap or 0.0), dtype=dt, kv_dtype=kv_dt,
                         scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim_qk))
        self._planned = True

    def _into_buf(self, key: str, t: Tensor, name: str, non_blocking: bool) -> Tensor:
        """``t`` on the device: copied into the caller's fixed buffer when one was given (graph
        mode needs one), else as is."""
        buf = self._bufs[key]
        if buf is None:
            if self._use_cuda_graph:
                _fail(f"use_cuda_graph=True with this plan needs {name} (its address must not "
                      f"change between plans)")
            return t.to(self._device).contiguous()
        if buf.dtype != t.dtype or buf.dim() != 1 or buf.numel() < t.numel() \
                or buf.device != self._device:
            _fail(f"{name} must be a 1-D {t.dtype} tensor of at least {t.numel()} entries on "
                  f"{self._device}, got {buf.dtype} {tuple(buf.shape)} on {buf.device}")
        buf[:t.numel()].copy_(t, non_blocking=non_blocking)
        return buf

    def run(self, q: Tensor, paged_kv_cache, *args, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            out: Optional[Tensor] = None, lse: Optional[Tensor] = None, return_lse: bool = False,
            **_unused):
        """q [total_q, H, D] -> out [total_q, H, D] (and base-2 LSE [total_q, H]). q_scale /
        k_scale multiply the softmax scale, v_scale the output (fp8 caches)."""
        q, k, v, out, lse_out, scale = _run_inputs(self, q, paged_kv_cache, self._total_q, out, lse,
                                                   True, q_scale, k_scale)
        c = self._cfg
        wl, wr = _prefill_window(c["causal"], c["window_left"])
        paged_attn(q, k, v, self._indices, self._seqlens_indptr, self._work, self._n_work, None,
                   self._work.shape[0], 1, c["block_m"], lse_out, lse_out, scale, wl, wr,
                   c["softcap"], out, lse_out, lse_base2=True, rope=c["rope"], mask=self._mask)
        if v_scale is not None:
            out.mul_(v_scale)
        return (out, lse_out) if return_lse else out

    forward = run
    begin_forward = plan


class MultiLevelCascadeAttentionWrapper:
    """Cascade attention over a paged cache in levels (FlashInfer's wrapper): level 0 is e.g. a
    prefix shared by every request, attended once by all their queries as one request; the last
    level is each request's own pages. Each level runs as a ``BatchPrefillWithPagedKVCacheWrapper``
    over its own CSR table (the pages may sit in one cache), and the levels' outputs are merged by
    their base-2 LSE (``merge_state_in_place``). ``causal`` applies to the last level only; the
    levels above hold keys that precede every query."""

    def __init__(self, num_levels: int, float_workspace_buffer: Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr=None,
                 paged_kv_indptr_buf_arr=None, paged_kv_indices_buf_arr=None,
                 paged_kv_last_page_len_buf_arr=None) -> None:
        """``use_cuda_graph=True`` needs one paged_kv_indices buffer per level
        (``paged_kv_indices_buf_arr``); the other buffer arrays are accepted as FlashInfer's."""
        if not isinstance(num_levels, int) or num_levels < 1:
            _fail(f"num_levels must be an int >= 1, got {num_levels!r}")
        if use_cuda_graph and (paged_kv_indices_buf_arr is None
                               or len(paged_kv_indices_buf_arr) != num_levels):
            _fail("use_cuda_graph=True needs paged_kv_indices_buf_arr with one buffer per level")
        bufs = paged_kv_indices_buf_arr or [None] * num_levels
        self._levels = [BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout,
                                                            use_cuda_graph=use_cuda_graph,
                                                            paged_kv_indices_buf=buf)
                        for buf in bufs]

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._levels[0]._use_cuda_graph

    def plan(self, qo_indptr_arr: list, paged_kv_indptr_arr: list, paged_kv_indices_arr: list,
             paged_kv_last_page_len: list, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, causal: bool = False, **kwargs) -> None:
        """One CSR table per level (lists of num_levels tensors); the remaining arguments are
        ``BatchPrefillWithPagedKVCacheWrapper.plan``'s, for every level."""
        arrays = (qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len)
        if any(not isinstance(a, (list, tuple)) or len(a) != len(self._levels) for a in arrays):
            _fail(f"qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr and "
                  f"paged_kv_last_page_len must be lists of {len(self._levels)} tensors (one per "
                  f"level)")
        totals = {int(qo[-1]) for qo in qo_indptr_arr}
        if len(totals) != 1:
            _fail(f"every level's qo_indptr must end at the same query count, got {sorted(totals)}")
        last = len(self._levels) - 1
        for i, (w, qo, ip, idx, lp) in enumerate(zip(self._levels, *arrays)):
            w.plan(qo, ip, idx, lp, num_qo_heads, num_kv_heads, head_dim, page_size,
                   causal=causal and i == last, **kwargs)

    def run(self, q: Tensor, paged_kv_cache) -> Tensor:
        """Attention of q [total_q, num_qo_heads, head_dim] over every level, merged. Returns out
        [total_q, num_qo_heads, head_dim]."""
        out, lse = self._levels[-1].run(q, paged_kv_cache, return_lse=True)
        for w in self._levels[:-1]:
            out_i, lse_i = w.run(q, paged_kv_cache, return_lse=True)
            merge_state_in_place(out, lse, out_i, lse_i)
        return out

    forward = run
    begin_forward = plan

"""Host-side planning for paged decode (FlashInfer's plan()): per-request KV lengths from the CSR
page table, a split of long requests into KV chunks so that all SMs are busy, and the work list
the kernels read. Buffers are sized by an upper bound that does not depend on the lengths, so a
CUDA graph captured once replays under every later plan of the same batch size."""
from __future__ import annotations

from dataclasses import dataclass


def kv_lengths(indptr: list[int], last_page_len: list[int], page_size: int) -> list[int]:
    """Tokens per request: full pages plus the last page's fill (0 for a request with no page)."""
    return [max(0, (indptr[i + 1] - indptr[i] - 1) * page_size + last_page_len[i])
            if indptr[i + 1] > indptr[i] else 0 for i in range(len(indptr) - 1)]


def max_work_items(batch: int, n_heads_k: int, sms: int) -> int:
    """Upper bound of ``split_work``'s items: the target count plus one partial chunk per request."""
    return target_items(batch, n_heads_k, sms) + batch


def target_items(batch: int, n_heads_k: int, sms: int) -> int:
    # about two programs per SM (each item runs once per KV head)
    return max(batch, -(-2 * sms // max(n_heads_k, 1)))


@dataclass
class DecodePlan:
    work: list[tuple[int, int, int, int, int]]  # (request, row block, first key, end key, slot or -1)
    slot_start: list[int]  # [batch + 1]: request b's partial slots are [slot_start[b], [b + 1])
    chunk: int


def split_work(lengths: list[int], n_heads_k: int, sms: int, min_chunk: int = 256,
               fixed_chunk: int | None = None) -> DecodePlan:
    """Chunks of at most ``chunk`` keys per work item; a request of one chunk writes its output
    directly, longer ones write partials merged afterwards."""
    total = sum(lengths)
    want = target_items(len(lengths), n_heads_k, sms)
    chunk = fixed_chunk or max(min_chunk, -(-total // want) if total else min_chunk)
    work, slot_start, slot = [], [0], 0
    for b, n in enumerate(lengths):
        pieces = max(1, -(-n // chunk))
        if pieces == 1:
            work.append((b, 0, 0, n, -1))
        else:
            # even pieces (whole 64-key tiles) rather than full chunks and a short tail: the
            # request's items then finish together
            step = chunk if fixed_chunk else -(-n // (pieces * 64)) * 64
            pieces = -(-n // step)
            for p in range(pieces):
                work.append((b, 0, p * step, min((p + 1) * step, n), slot))
                slot += 1
        slot_start.append(slot)
    return DecodePlan(work, slot_start, chunk)



"""Host-side planning for paged decode (FlashInfer's plan()): per-request KV lengths from the CSR
page table, a split of long requests into KV chunks so that all SMs are busy, and the work list
the kernels read. Buffers are sized by an upper bound that does not depend on the lengths, so a
CUDA graph captured once replays under every later plan of the same batch size."""
from __future__ import annotations

import bisect
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
    # (``split_work_balanced``) [columns + 1]: column c's items are work[columns[c]:columns[c + 1]]
    columns: list[int] | None = None


def balanced_columns(n_heads_k: int, sms: int) -> int:
    """Columns of ``split_work_balanced``: one CTA per column and KV head, two per SM."""
    return max(1, 2 * sms // max(n_heads_k, 1))


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




def split_work_balanced(lengths: list[int], n_heads_k: int, sms: int, block: int = 64) -> DecodePlan:
    """FlashInfer's balanced split: the requests' key tiles (``block`` keys) laid end to end and
    cut into ``balanced_columns`` runs of equal tiles, so that the sm90 decode kernel's CTAs (one
    per column and KV head, all resident at once) each read the same bytes, looping over their
    column's pieces; a request cut into several pieces writes partials merged afterwards, as
    ``split_work``'s split requests do. Every KV head splits the same way. The pieces are work
    items in ``split_work``'s format (the portable kernel runs them one per program); at most
    columns + batch of them (each cut adds one piece)."""
    cols = balanced_columns(n_heads_k, sms)
    tiles = [-(-n // block) for n in lengths]
    total = sum(tiles)
    # column c covers tiles [c * total // cols, (c + 1) * total // cols) of the whole run
    bounds = [c * total // cols for c in range(cols + 1)]
    work, slot_start, item_cols = [], [0], []
    col, pos = 0, 0  # pos: tiles of the whole run before this request's next piece
    for b, n in enumerate(lengths):
        pieces = []  # (first key, end key, column); an empty request: one item all the same
        t0 = 0
        while t0 < tiles[b] or not pieces:
            while t0 < tiles[b] and bounds[col + 1] <= pos:  # (columns of no tiles stay empty)
                col += 1
            take = min(tiles[b] - t0, bounds[col + 1] - pos)
            pieces.append((t0 * block, min((t0 + take) * block, n), col))
            t0 += take
            pos += take
        slot = slot_start[-1]
        for lo, hi, c in pieces:  # a request of several pieces writes partials, a slot each
            work.append((b, 0, lo, hi, slot if len(pieces) > 1 else -1))
            item_cols.append(c)
            slot += len(pieces) > 1
        slot_start.append(slot)
    columns = [bisect.bisect_left(item_cols, c) for c in range(cols + 1)]
    return DecodePlan(work, slot_start, -(-total // cols) * block, columns)

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


def max_work_items(batch: int, n_heads_k: int, sms: int) -> int:
    """Upper bound of ``split_work``'s items: its largest target count plus one partial chunk
    per request."""
    return max(split_targets(batch, n_heads_k, sms)) + batch


def split_targets(batch: int, n_heads_k: int, sms: int) -> list[int]:
    """``split_work``'s candidate item counts, fewest first: the batch (requests split only as
    far as the mean length), and one or two CTAs per SM over the KV heads; three when the batch
    alone gives two (48 x 4k at 8 KV heads: 768 CTAs, 3.85 TB/s against 3.60 unsplit). With fewer
    requests three did not gain in the sweeps (a second wave of short items: 8 x 8k 3.00 TB/s on
    448 CTAs against 3.26 on 192), and leaving it out keeps ``max_work_items``, the grid a
    captured graph launches, as it was for those batches (batches from two to three CTAs per
    SM's worth get a larger bound: 50 + batch items at 8 KV heads on 132 SMs, not 2 x batch)."""
    per_sm = [-(-j * sms // max(n_heads_k, 1)) for j in (1, 2, 3)]
    if batch < per_sm[1]:
        per_sm.pop()
    return sorted({max(batch, t) for t in per_sm} | {batch})


# (``decode_cost``) the keys' worth of time a work item costs beyond its keys (its first tiles'
# latency, the partial's store and merge), and a launch of at most one CTA per SM as a share of
# a wave: a lone CTA streams about twice a co-resident one's rate. Fitted to the sm90 decode
# kernel's per-SM sweeps on the H200 (results/tune/tune_sm90_decode_persm*_f341af4_*: 16 x 8k
# 3.84 TB/s on 128 CTAs, 3.77 on 256, 3.28 on 384; 12 x 8k 3.49 / 2.82 on 192 / 288 CTAs)
ITEM_OVERHEAD_KEYS = 1000
LONE_WAVE = 0.55


def decode_cost(ctas: int, keys: int, sms: int) -> float:
    """Estimated time, in keys streamed by one CTA, of a decode launch of ``ctas`` CTAs of at
    most ``keys`` keys each. Two CTAs are resident per SM, so they run in waves of 2 x sms, and
    a wave that is not the first is taken to last as long as a full one whatever its size: 384
    CTAs on 264 slots ran 13% slower than 256 or 512 (the same keys in all; why a short second
    wave is that slow was not measured). A launch of at most one CTA per SM runs in
    ``LONE_WAVE`` of a wave."""
    waves = LONE_WAVE if ctas <= sms else -(-ctas // (2 * sms))
    return waves * (keys + ITEM_OVERHEAD_KEYS)


def _split(lengths: list[int], chunk: int, fixed: bool) -> tuple[list, list[int], int]:
    """Work items of at most ``chunk`` keys (``split_work``'s format), their slot starts, and the
    longest item's keys."""
    work, slot_start, slot, longest = [], [0], 0, 0
    for b, n in enumerate(lengths):
        pieces = max(1, -(-n // chunk))
        if pieces == 1:
            work.append((b, 0, 0, n, -1))
            longest = max(longest, n)
        else:
            # even pieces (whole 64-key tiles) rather than full chunks and a short tail: the
            # request's items then finish together
            step = chunk if fixed else -(-n // (pieces * 64)) * 64
            pieces = -(-n // step)
            for p in range(pieces):
                work.append((b, 0, p * step, min((p + 1) * step, n), slot))
                slot += 1
            longest = max(longest, step)
        slot_start.append(slot)
    return work, slot_start, longest


def split_work(lengths: list[int], n_heads_k: int, sms: int, min_chunk: int = 256,
               fixed_chunk: int | None = None) -> DecodePlan:
    """Chunks of at most ``chunk`` keys per work item; a request of one chunk writes its output
    directly, longer ones write partials merged afterwards. Without ``fixed_chunk`` the chunk
    is the one of ``split_targets``' item counts whose launch (items x KV heads CTAs) has the
    lowest ``decode_cost``, the fewest items on a tie: a split that leaves a second wave of a
    few CTAs is avoided (16 x 8k at 8 KV heads runs unsplit, 128 CTAs, not 384)."""
    if fixed_chunk:
        work, slot_start, _ = _split(lengths, fixed_chunk, True)
        return DecodePlan(work, slot_start, fixed_chunk)
    total = sum(lengths)
    best = None
    for want in split_targets(len(lengths), n_heads_k, sms):
        chunk = max(min_chunk, -(-total // want) if total else min_chunk)
        work, slot_start, longest = _split(lengths, chunk, False)
        cost = decode_cost(len(work) * max(n_heads_k, 1), longest, sms)
        if best is None or cost < best[0]:
            best = (cost, DecodePlan(work, slot_start, chunk))
    return best[1]


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

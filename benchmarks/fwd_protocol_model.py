"""A model of the persistent sm90 forward's barrier protocol, run under random interleavings.

The producer warp and the consumer warpgroups of ``ioattn.dense.sm90_fwd`` as Python generators,
with mbarriers as phase counters (``try_wait.parity`` semantics: a wait on parity p passes once
the barrier's phase parity differs from p; a fresh barrier passes parity 1), written after the
kernel's persistent producer / consumer and store code: Q in ``Q_BUFS`` buffers taken by tiles
with key blocks in turn, and O staged in the
tile's last V stage (``O_TMA`` 2, released a block into the next tile after the warpgroups meet
at o_bar) or in the warpgroup's piece of the tile's Q buffer (3); tiles without key blocks take
no buffer. q_early (``Q_FREED_EARLY``: all of Q in registers, one buffer): each warpgroup
releases Q's buffer as soon as it has loaded Q, not after the tile's last QKᵀ. Each run checks that every thread finishes (no deadlock) and that no Q, K or V
buffer is written while a consumer still reads it (or holds O in it), for random tile lists
over ring depths 2-4 and two or three consumer warpgroups.

It models the protocol, not the kernel: it does not read sm90_fwd, so a change to the kernel's
phases or arrivals must be made here too to be checked. Mutating a phase (Q's by all tiles
instead of tiles with work, an arrival left in) makes it report a deadlock.

    python benchmarks/fwd_protocol_model.py [--seeds 3000]
"""
import argparse
import random


class Bar:
    """An mbarrier: completes a phase once ``count`` arrivals are in."""

    def __init__(self, count: int):
        self.count, self.arrived, self.phase = count, 0, 0

    def arrive(self) -> None:
        self.arrived += 1
        assert self.arrived <= self.count
        if self.arrived == self.count:
            self.arrived, self.phase = 0, self.phase + 1

    def done(self, parity: int) -> bool:  # mbarrier.try_wait.parity
        return (self.phase & 1) != parity


def wait(bar: Bar, parity: int):
    while not bar.done(parity):
        yield


def run(tiles: list[int], q_bufs: int, stages: int, wgs: int, o_mode: int, seed: int,
        q_early: bool = False) -> None:
    """One launch's CTA over ``tiles`` (key blocks a tile), threads stepped in random order."""
    q_bar = [Bar(1) for _ in range(q_bufs)]
    q_empty = [Bar(wgs) for _ in range(q_bufs)]
    k_full, v_full = [Bar(1) for _ in range(stages)], [Bar(1) for _ in range(stages)]
    k_empty, v_empty = [Bar(wgs) for _ in range(stages)], [Bar(wgs) for _ in range(stages)]
    o_bar = Bar(wgs)
    q_data, k_data, v_data = [None] * q_bufs, [None] * stages, [None] * stages
    q_users = [set() for _ in range(q_bufs)]  # warpgroups reading Q (or, 3, holding O) there
    k_users = [set() for _ in range(stages)]
    v_users = [set() for _ in range(stages)]  # warpgroups reading V (or, 2, holding O) there

    def load_kv(t, it, j):
        i = it + j
        st, ph = i % stages, ((i // stages) & 1) ^ 1
        yield from wait(k_empty[st], ph)
        assert not k_users[st], ("K overwritten while read", t, j)
        k_data[st] = (t, j)
        k_full[st].arrive()
        yield from wait(v_empty[st], ph)
        assert not v_users[st], ("V overwritten while read", t, j)
        v_data[st] = (t, j)
        v_full[st].arrive()

    def producer():  # _producer_persistent / _produce_tile
        it = tc = 0  # key tiles loaded, tiles with key blocks so far
        for t, n in enumerate(tiles):
            buf, use = tc % q_bufs, tc // q_bufs
            if n > 0:
                yield from wait(q_empty[buf], (use & 1) ^ 1)
                assert not q_users[buf], ("Q overwritten while read", t)
                q_data[buf] = t
                q_bar[buf].arrive()
            for j in range(n):
                yield from load_kv(t, it, j)
            it += n
            tc += n > 0

    def consumer(w):  # _consumer_persistent / _consume_tile / _store_tile
        it = tc = pend = 0  # pend: the V stage (2) or Q buffer (3) + 1 still holding O

        def release(pend):  # _release_o_stage
            if pend and o_mode == 2:
                v_users[pend - 1].discard(w)
                v_empty[pend - 1].arrive()
            if pend and o_mode == 3:
                q_users[pend - 1].discard(w)
                q_empty[pend - 1].arrive()

        for t, n in enumerate(tiles):
            buf, use = tc % q_bufs, tc // q_bufs
            if n == 0:  # no key block: no Q, the previous O released at once
                release(pend)
                pend = 0
                continue
            yield from wait(q_bar[buf], use & 1)
            assert q_data[buf] == t, ("wrong Q", t, q_data[buf])
            q_users[buf].add(w)
            if q_early:  # Q loaded into registers: its buffer goes back at once
                yield
                assert q_data[buf] == t, ("Q replaced under its register load", t)
                q_users[buf].discard(w)
                q_empty[buf].arrive()
            for j in range(n):  # QK_j, then PV_{j-1}
                st = (it + j) % stages
                yield from wait(k_full[st], ((it + j) // stages) & 1)
                assert k_data[st] == (t, j), ("wrong K", t, j)
                k_users[st].add(w)
                yield
                assert q_early or q_data[buf] == t, ("Q replaced under QK", t, j)
                k_users[st].discard(w)
                k_empty[st].arrive()
                if j == 0:  # the previous tile's O store released after the first block
                    release(pend)
                    pend = 0
                if j > 0:
                    yield from pv(t, it, j - 1, w, release_stage=True)
            if o_mode != 3 and not q_early:  # every QKᵀ retired: Q's buffer back
                q_users[buf].discard(w)
                q_empty[buf].arrive()
            last = (it + n - 1) % stages
            yield from pv(t, it, n - 1, w, release_stage=o_mode in (0, 3))
            if o_mode == 3:  # O in the warpgroup's piece of this tile's Q buffer
                assert q_data[buf] == t, ("Q buffer reloaded under O", t)
                pend = buf + 1
            elif o_mode == 2:  # O in the last V stage, once every warpgroup's P·V is done
                o_bar.arrive()
                yield from wait(o_bar, tc & 1)
                assert v_data[last] == (t, n - 1), ("V stage reloaded under O", t)
                pend = last + 1
            it += n
            tc += 1

    def pv(t, it, j, w, release_stage):
        st = (it + j) % stages
        yield from wait(v_full[st], ((it + j) // stages) & 1)
        assert v_data[st] == (t, j), ("wrong V", t, j)
        v_users[st].add(w)
        yield
        if release_stage:
            v_users[st].discard(w)
            v_empty[st].arrive()

    rng = random.Random(seed)
    threads = [producer()] + [consumer(w) for w in range(wgs)]
    steps = 0
    while threads:
        th = rng.choice(threads)
        try:
            next(th)
        except StopIteration:
            threads.remove(th)
        steps += 1
        if steps > 200_000:
            raise RuntimeError(f"deadlock: tiles {tiles}, Q buffers {q_bufs}, stages {stages}, "
                               f"warpgroups {wgs}, O mode {o_mode}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3000)
    n_runs = 0
    for seed in range(ap.parse_args().seeds):
        rng = random.Random(seed)
        tiles = [rng.choice([0, 0, 1, 1, 2, 3, 5, 8]) for _ in range(rng.randint(1, 12))]
        # (Q buffers, O store) as launch_form pairs them: one buffer with O from registers or
        # the V stage, two with O from registers or the Q buffer
        # (and Q freed once in registers: one buffer, O from registers or the V stage)
        for q_bufs, o_mode, q_early in ((1, 0, False), (1, 2, False), (2, 0, False),
                                        (2, 3, False), (1, 0, True), (1, 2, True)):
            for stages in (2, 3, 4):
                for wgs in (2, 3):
                    run(tiles, q_bufs, stages, wgs, o_mode, seed * 7 + stages, q_early)
                    n_runs += 1
    print(f"ok: {n_runs} runs, no deadlock, no buffer written while read")


if __name__ == "__main__":
    main()

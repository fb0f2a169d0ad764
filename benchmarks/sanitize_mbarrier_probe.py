"""Does compute-sanitizer racecheck follow mbarrier synchronization? The sm90 forward's dynamic
scheduler hands tile ids from its producer warp to the consumer warpgroup through a 2-slot
shared-memory ring guarded by mbarriers (``sm90_fwd._publish_tile`` / ``_read_tile``): a plain
shared store, then an mbarrier arrive (release); the reader's mbarrier wait (acquire), a plain
shared load, then its arrive on the slot's empty barrier. This kernel runs exactly those two
functions in a bare warp_specialize and checks every id arrived. If racecheck reports hazards
here while the ids are all right, its hazards on the attention kernels' tile ids (and on the
backward's LSE / delta rows, handed over the same way) are its not modelling mbarriers, not races.
    compute-sanitizer --tool racecheck python benchmarks/sanitize_mbarrier_probe.py"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from ioattn.dense.sm90_common import barriers, invalidate
from ioattn.dense.sm90_fwd import _publish_tile, _read_tile


@gluon.jit
def _ids_consumer(out_ptr, tile_smem, tile_full, tile_empty, n):
    for k in range(n):
        t = _read_tile(tile_smem, tile_full, tile_empty, k)
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        gl.store(out_ptr + k + gl.arange(0, 1, layout=layout), gl.full([1], t, gl.int32, layout))


@gluon.jit
def _ids_producer(tile_smem, tile_full, tile_empty, n):
    for k in range(n):
        _publish_tile(tile_smem, tile_full, tile_empty, 7 * k + 1, k)


@gluon.jit
def _ids_kernel(out_ptr, n):
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_full = barriers(2, 1)
    tile_empty = barriers(2, 1)  # one consumer warpgroup
    fence_async_shared()
    gl.warp_specialize([(_ids_consumer, (out_ptr, tile_smem, tile_full, tile_empty, n)),
                        (_ids_producer, (tile_smem, tile_full, tile_empty, n))], [1], [24])
    invalidate(tile_full, 2)
    invalidate(tile_empty, 2)


if __name__ == "__main__":
    n = 64
    out = torch.full((4, n), -1, dtype=torch.int32, device="cuda")
    for i in range(4):
        _ids_kernel[(1,)](out[i], n, num_warps=4)
    torch.cuda.synchronize()
    want = 7 * torch.arange(n, device="cuda", dtype=torch.int32) + 1
    assert bool((out == want).all()), out
    print("mbarrier probe done")

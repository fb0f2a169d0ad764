"""The smallest warp-specialized Gluon kernel, for compute-sanitizer racecheck: does racecheck
flag Triton's own warp_specialize dispatch (the worker warps' per-warp state bytes in shared
memory, read after named barrier 1) when the partitions share nothing? If it reports the same
kernel-start hazards as the attention kernels (benchmarks/NOTES.md, session 4), those come from
the generated dispatch, not from ioattn's tiles. Session 5: the two-partition kernel gave 0
hazards; the three-partition kernel mirrors the attention kernels' partitions and registers.
    compute-sanitizer --tool racecheck python benchmarks/sanitize_ws_minimal.py"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _store_ones(out_ptr, base: gl.constexpr, n: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offs = base + gl.arange(0, n, layout=layout)
    gl.store(out_ptr + offs, gl.full([n], 1.0, gl.float32, layout=layout))


@gluon.jit
def _ws_kernel(out_ptr, n: gl.constexpr):
    gl.warp_specialize([(_store_ones, (out_ptr, 0, n)), (_store_ones, (out_ptr, n, n))],
                       [1], [24])


@gluon.jit
def _ws3_kernel(out_ptr, n: gl.constexpr):
    # the attention kernels' shape: a default warpgroup, a 4-warp worker and a 1-warp worker at
    # 240 / 24 registers (12 warps launched, 3 of them idle padding)
    gl.warp_specialize([(_store_ones, (out_ptr, 0, n)), (_store_ones, (out_ptr, n, n)),
                        (_store_ones, (out_ptr, 2 * n, n))], [4, 1], [240, 24])


if __name__ == "__main__":
    out = torch.zeros(2 * 128, device="cuda")
    _ws_kernel[(4,)](out, 128, num_warps=4)
    torch.cuda.synchronize()
    assert bool((out == 1).all()), "the two partitions did not both run"
    out3 = torch.zeros(3 * 128, device="cuda")
    _ws3_kernel[(4,)](out3, 128, num_warps=4)
    torch.cuda.synchronize()
    assert bool((out3 == 1).all()), "the three partitions did not all run"
    print("ws minimal done")

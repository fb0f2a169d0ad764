"""One decode cell's kernels for ncu: the planned decode (run()) and SDPA cuDNN on the same K/V in
contiguous form, each launched a few times after a warm-up, so ncu can compare their time on the
GPU and DRAM throughput kernel by kernel (what the per-call timings mix with launch overhead).
    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum.per_second \\
        python benchmarks/profile_decode.py --cell 64x4096x16"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ioattn.flashinfer as fi
from tune_decode import decode_cell  # (run as a script: benchmarks/ is on sys.path)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--cell", default="64x4096x16", help="batch x context x page size")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--whole", action="store_true",
                   help="also run() over cuDNN's own K/V as an HND cache of one page a request "
                        "(page = context): the same bytes in the same order as cuDNN reads, so "
                        "the kernels differ and the layout does not")
    a = p.parse_args(argv)
    b, ctx, page = (int(x) for x in a.cell.split("x"))
    h, h_k, d, dt = 32, 8, 128, torch.bfloat16
    cache, indptr, indices, last, q, _, nbytes = decode_cell(b, ctx, page, h, h_k, d, dt)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, last, h, h_k, d, page, q_data_type=dt)
    k = torch.randn(b, h_k, ctx, d, device="cuda", dtype=dt)
    v = torch.randn(b, h_k, ctx, d, device="cuda", dtype=dt)
    qt = q[:, :, None, :]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, k, v, enable_gqa=True)

    fns = [lambda: w.run(q, cache), cudnn]
    if a.whole:  # [b, 2, h_k, ctx, d]: request i's K and V as page i, HND
        whole = torch.stack((k, v), dim=1)
        w2 = fi.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), kv_layout="HND")
        w2.plan(torch.arange(b + 1, dtype=torch.int32), torch.arange(b, dtype=torch.int32).cuda(),
                torch.full((b,), ctx, dtype=torch.int32), h, h_k, d, ctx, q_data_type=dt)
        fns.append(lambda: w2.run(q, whole))
    for fn in fns:
        fn()  # warm-up: compiles and plans
        torch.cuda.synchronize()
        for _ in range(a.reps):
            fn()
        torch.cuda.synchronize()
    print(f"K+V bytes per call: {nbytes}")


if __name__ == "__main__":
    main()

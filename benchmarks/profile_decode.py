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
    p.add_argument("--layouts", default="",
                   help="also run() over the same cell's K/V in these layouts, in this order after "
                        "cuDNN: hnd-whole (cuDNN's own K/V as an HND cache of one page a request: "
                        "the same bytes in the same order as cuDNN reads), nhd-whole (one page a "
                        "request, NHD: a contiguous [b, s, h_k, d] cache), hnd-paged (the paged "
                        "cache's pages as HND, same page table)")
    a = p.parse_args(argv)
    b, ctx, page = (int(x) for x in a.cell.split("x"))
    h, h_k, d, dt = 32, 8, 128, torch.bfloat16
    cache, indptr, indices, last, q, _, nbytes = decode_cell(b, ctx, page, h, h_k, d, dt)
    k = torch.randn(b, h_k, ctx, d, device="cuda", dtype=dt)
    v = torch.randn(b, h_k, ctx, d, device="cuda", dtype=dt)
    qt = q[:, :, None, :]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, k, v, enable_gqa=True)

    def wrapper(layout, pages, table, lens, page_size):
        w_ = fi.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), kv_layout=layout)
        w_.plan(*table, lens, h, h_k, d, page_size, q_data_type=dt)
        return lambda: w_.run(q, pages)

    whole_table = (torch.arange(b + 1, dtype=torch.int32), torch.arange(b, dtype=torch.int32).cuda())
    whole_last = torch.full((b,), ctx, dtype=torch.int32)
    fns = [wrapper("NHD", cache, (indptr, indices), last, page), cudnn]
    for layout in filter(None, a.layouts.split(",")):
        if layout == "hnd-whole":  # [b, 2, h_k, ctx, d]: request i's K and V as page i
            fns.append(wrapper("HND", torch.stack((k, v), dim=1), whole_table, whole_last, ctx))
        elif layout == "nhd-whole":  # [b, 2, ctx, h_k, d]
            kv = torch.stack((k.transpose(1, 2), v.transpose(1, 2)), dim=1).contiguous()
            fns.append(wrapper("NHD", kv, whole_table, whole_last, ctx))
        elif layout == "hnd-paged":  # [pages, 2, h_k, page, d], the same page table
            fns.append(wrapper("HND", cache.permute(0, 1, 3, 2, 4).contiguous(), (indptr, indices),
                               last, page))
        else:
            raise SystemExit(f"--layouts: unknown layout {layout!r}")
    for fn in fns:
        fn()  # warm-up: compiles and plans
        torch.cuda.synchronize()
        for _ in range(a.reps):
            fn()
        torch.cuda.synchronize()
    print(f"K+V bytes per call: {nbytes}")


if __name__ == "__main__":
    main()

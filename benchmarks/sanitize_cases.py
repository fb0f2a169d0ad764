"""A few small calls of the sm90 (Gluon) kernels and the serving kernels, for compute-sanitizer:
    compute-sanitizer --tool memcheck python benchmarks/sanitize_cases.py   (and racecheck)"""
import torch

import ioattn
import ioattn.flashinfer as fi

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
for d in (64, 128, 256):
    for causal in (False, True):
        q, k, v = (torch.randn(2, 203, 4, d, device=dev, dtype=dt) for _ in range(3))
        ioattn.flash_attn_func(q, k, v, causal=causal, backend="sm90")
q, k, v = (torch.randn(1, 300, 4, 128, device=dev, dtype=dt) for _ in range(3))
ioattn.flash_attn_func(q, k, v, window_size=(50, 7), backend="sm90")
cu = torch.tensor([0, 0, 77, 300], dtype=torch.int32, device=dev)
qv, kv, vv = (torch.randn(300, 4, 128, device=dev, dtype=dt) for _ in range(3))
ioattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, 223, 223, causal=True, backend="sm90")
# the persistent forward on 3 CTAs, so each walks many tiles: the two Q buffers taken in turn
# (the default up to 8k keys, d=64 masked and d=128), O stored from the tile's Q piece
from ioattn.dense import sm90_fwd  # noqa: E402

_sms = sm90_fwd.sm_count
sm90_fwd.sm_count = lambda device: 3
for d, causal in ((64, True), (128, False), (128, True)):
    # twice, new inputs: the second call takes the kept launch and the stream's tile
    # counter as the first call's last CTA left it (IOATTN_SM90_FWD_STREAM_COUNTERS)
    for _ in range(2):
        q, k, v = (torch.randn(2, 331, 4, d, device=dev, dtype=dt) for _ in range(3))
        ioattn.flash_attn_func(q, k, v, causal=causal, backend="sm90")
sm90_fwd.sm_count = _sms
# the sm90 backward kernels (d=64: the fused form on 128-row steps, the last one partial),
# twice each: the second through its kept launches (IOATTN_SM90_BWD_BIND)
for d, causal in ((128, True), (64, False), (64, True)):
    for _ in range(2):
        q, k, v = (torch.randn(1, 203, 4, d, device=dev, dtype=dt, requires_grad=True)
                   for _ in range(3))
        out = ioattn.flash_attn_func(q, k, v, causal=causal, backend="sm90")
        out.backward(torch.randn_like(out))
# serving: decode wrapper, kv-cache call
cache = torch.randn(40, 2, 16, 2, 128, device=dev, dtype=dt)
w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=dev))
w.plan(torch.tensor([0, 10, 30], dtype=torch.int32), torch.arange(30, dtype=torch.int32, device=dev),
       torch.tensor([5, 16], dtype=torch.int32), 8, 2, 128, 16, q_data_type=dt, fixed_split_size=64)
w.run(torch.randn(2, 8, 128, device=dev, dtype=dt), cache)
# head dim 256 on the sm90 decode kernel (IOATTN_SM90_DECODE_D256), run twice (kept launch)
cache256 = torch.randn(40, 2, 16, 2, 256, device=dev, dtype=dt)
w256 = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=dev))
w256.plan(torch.tensor([0, 10, 30], dtype=torch.int32), torch.arange(30, dtype=torch.int32, device=dev),
          torch.tensor([5, 16], dtype=torch.int32), 8, 2, 256, 16, q_data_type=dt)
for _ in range(2):
    w256.run(torch.randn(2, 8, 256, device=dev, dtype=dt), cache256)
ioattn.flash_attn_with_kvcache(torch.randn(2, 3, 8, 128, device=dev, dtype=dt), cache[:, 0], cache[:, 1],
                               cache_seqlens=torch.tensor([100, 300], dtype=torch.int32, device=dev),
                               block_table=torch.arange(40, dtype=torch.int32, device=dev).view(2, 20),
                               causal=True, num_splits=3)
torch.cuda.synchronize()
print("sanitize cases done")

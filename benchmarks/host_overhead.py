"""Host time of one attention call (what an eager caller pays before the kernel runs): tiny
shapes so the GPU never holds the host back; per-call microseconds for the forward, the forward
+ backward, and the planned decode run(); the FA-grid d=128 causal 2k shape's forward and
backward alone (calls enqueued faster than the GPU runs them); then cProfiles of each.
    python benchmarks/host_overhead.py [--json out.json]"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import time

import torch

import ioattn
import ioattn.flashinfer as fi


def _per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return round(us, 1)


def _bwd_only_us(leaves, **kw) -> float:
    """Host us a call of the backward alone: autograd from one kept forward graph over the
    leaves (``flash_attn_func`` with ``kw``), their grads dropped each call."""
    out = ioattn.flash_attn_func(*leaves, **kw)
    dout = torch.randn_like(out)

    def bwd_only():
        for t in leaves:
            t.grad = None
        out.backward(dout, retain_graph=True)
    us = _per_call_us(bwd_only)
    for t in leaves:
        t.grad = None
    return us


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--graph", action="store_true", help="the 2k cells eager vs graph-replayed")
    p.add_argument("--graph-seqlens", default="2048",
                   help="with --graph: the FA-grid sequence lengths (comma-separated)")
    p.add_argument("--graph-backend", default="auto",
                   help="with --graph: ioattn's backend (auto, triton, sm90)")
    p.add_argument("--graph-dims", default="64,128,256",
                   help="with --graph: the head dims (comma-separated)")
    p.add_argument("--graph-modes", default="fwd,bwd",
                   help="with --graph: fwd, bwd or both (comma-separated)")
    a = p.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    q, k, v = (torch.randn(1, 128, 16, 128, device=dev, dtype=dt) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    res = {}
    for backend in ("auto", "triton", "sm90"):
        res[f"fwd_{backend}"] = _per_call_us(lambda: ioattn.flash_attn_func(q, k, v, backend=backend))
        res[f"fwd_causal_{backend}"] = _per_call_us(
            lambda: ioattn.flash_attn_func(q, k, v, causal=True, backend=backend))
        res[f"fwd_bwd_{backend}"] = _per_call_us(
            lambda: ioattn.flash_attn_func(qg, kg, vg, backend=backend).sum().backward())
    # where the forward's host time goes: the public call, the registered op through the
    # dispatcher, the op's body called directly, and the portable launcher alone
    from ioattn.dense import op as dense_op
    from ioattn.dense.params import make_params
    from ioattn.dense.triton_fwd import attn_fwd

    args = (q, k, v, None, None, 128, 128, 0.088, -1, -1, 0.0, None, 0.0, None, "triton", "triton",
            False)
    res["op_dispatcher"] = _per_call_us(lambda: torch.ops.ioattn.dense_fwd(*args))
    res["op_body"] = _per_call_us(lambda: dense_op.fwd_impl(*args))
    prm = make_params(q, k, v, None, None, 128, 128, 0.088, -1, -1, 0.0, None, 0.0, None)
    o, lse = torch.empty_like(q), torch.empty(1, 16, 128, device=dev)
    res["launch_only"] = _per_call_us(lambda: attn_fwd(prm, q, k, v, o, lse))
    # the sm90 forward's kept launches (IOATTN_SM90_FWD_BIND), off / on in one process
    from ioattn.dense import sm90_fwd

    saved = sm90_fwd.BIND
    for bind in (False, True):
        sm90_fwd.BIND = bind
        res[f"fwd_sm90_bind{int(bind)}"] = _per_call_us(
            lambda: ioattn.flash_attn_func(q, k, v, backend="sm90"))
    sm90_fwd.BIND = saved
    # (session 38) the sm90 forward's kept launch keyed by the op's signature (IOATTN_BIND) or by
    # its own key (off), and its tile counter kept per stream (IOATTN_SM90_FWD_STREAM_COUNTERS)
    saved = dense_op.BIND, sm90_fwd.STREAM_COUNTERS
    for name, op_key, counters in (("opkey0", False, False), ("opkey1", True, False),
                                   ("opkey1_counters1", True, True)):
        dense_op.BIND, sm90_fwd.STREAM_COUNTERS = op_key, counters
        dense_op.clear_memos()
        res[f"fwd_sm90_{name}"] = _per_call_us(
            lambda: ioattn.flash_attn_func(q, k, v, backend="sm90"))
        res[f"fwd_causal_sm90_{name}"] = _per_call_us(
            lambda: ioattn.flash_attn_func(q, k, v, causal=True, backend="sm90"))
    dense_op.BIND, sm90_fwd.STREAM_COUNTERS = saved
    dense_op.clear_memos()
    # the portable kernels' kept launches (IOATTN_BIND), off / on: the forward (causal too)
    # and the backward alone (autograd from a kept graph, the leaves' grads dropped each call)
    saved = dense_op.BIND
    for bind in (False, True):
        dense_op.BIND = bind
        dense_op.clear_memos()
        res[f"fwd_triton_bind{int(bind)}"] = _per_call_us(
            lambda: ioattn.flash_attn_func(q, k, v, backend="triton"))
        res[f"fwd_causal_triton_bind{int(bind)}"] = _per_call_us(
            lambda: ioattn.flash_attn_func(q, k, v, causal=True, backend="triton"))
        res[f"bwd_triton_bind{int(bind)}"] = _bwd_only_us((qg, kg, vg), backend="triton")
    dense_op.BIND = saved
    dense_op.clear_memos()
    # (session 39) the sm90 backward's kept launches (IOATTN_SM90_BWD_BIND), off / on: the
    # backward alone, fused (the default) and deterministic (two kernels)
    from ioattn.dense import sm90_bwd

    saved = sm90_bwd.BIND
    for bind in (False, True):
        sm90_bwd.BIND = bind
        for det in (False, True):
            res[f"bwd_sm90{'_det' if det else ''}_bind{int(bind)}"] = _bwd_only_us(
                (qg, kg, vg), backend="sm90", deterministic=det)
    sm90_bwd.BIND = saved
    res["sdpa_fwd"] = _per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
    # planned decode, 4 requests of 256 keys, pages of 16, GQA 32/8
    n_pages, page = 64, 16
    cache = torch.randn(n_pages, 2, page, 8, 128, device=dev, dtype=dt)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev))
    w.plan(torch.arange(0, 65, 16, dtype=torch.int32), torch.arange(64, dtype=torch.int32).to(dev),
           torch.full((4,), page, dtype=torch.int32), 32, 8, 128, page, q_data_type=dt)
    qd = torch.randn(4, 32, 128, device=dev, dtype=dt)
    res["decode_run"] = _per_call_us(lambda: w.run(qd, cache))
    # an engine's step: plan() from a new page-table tensor (the same lengths), then run() over
    # 8 layers' caches; us per step
    layers = [torch.randn_like(cache) for _ in range(8)]
    indptr_d = torch.arange(0, 65, 16, dtype=torch.int32)
    last_d = torch.full((4,), page, dtype=torch.int32)

    def step():
        w.plan(indptr_d, torch.arange(64, dtype=torch.int32).to(dev), last_d, 32, 8, 128, page,
               q_data_type=dt)
        for layer in layers:
            w.run(qd, layer)
    res["decode_step_plan_8_runs"] = _per_call_us(step, n=100)
    # the index tensors kept across calls, as a model's layers pass them (new ones each call
    # would pay the value checks' host sync every time: the first measurements did)
    lens_d = torch.full((4,), 256, dtype=torch.int32, device=dev)
    table_d = torch.arange(64, dtype=torch.int32, device=dev).view(4, 16)
    res["kvcache_decode"] = _per_call_us(lambda: ioattn.flash_attn_with_kvcache(
        qd[:, None], cache[:, 0], cache[:, 1], cache_seqlens=lens_d, block_table=table_d))
    # the FA-grid shape where the 2k causal cells are host-bound (results/tune/host_time_76fc236_*):
    # forward, and backward alone (autograd.grad on a kept graph), through sm90 and the portable
    # kernels; then profiles sorted by own time, Triton's launch internals included
    qb, kb, vb = (torch.randn(8, 2048, 16, 128, device=dev, dtype=dt, requires_grad=True)
                  for _ in range(3))
    dob = torch.randn_like(qb)
    big = {}
    for backend in ("sm90", "triton"):
        ob = ioattn.flash_attn_func(qb, kb, vb, causal=True, backend=backend)
        with torch.no_grad():
            res[f"fwd_2k_causal_{backend}"] = _per_call_us(
                lambda: ioattn.flash_attn_func(qb, kb, vb, causal=True, backend=backend), n=100)
        res[f"bwd_2k_causal_{backend}"] = _per_call_us(
            lambda: torch.autograd.grad(ob, (qb, kb, vb), dob, retain_graph=True), n=50)
        big[backend] = ob
    print(json.dumps(res, indent=1))

    def fwd_sm90():
        with torch.no_grad():
            return ioattn.flash_attn_func(qb, kb, vb, causal=True, backend="sm90")

    for name, fn, n in (("fwd_auto", lambda: ioattn.flash_attn_func(q, k, v), 200),
                        ("fwd_bwd_triton", lambda: ioattn.flash_attn_func(
                            qg, kg, vg, backend="triton").sum().backward(), 200),
                        ("fwd_2k_causal_sm90", fwd_sm90, 100),
                        ("bwd_2k_causal_sm90", lambda: torch.autograd.grad(
                            big["sm90"], (qb, kb, vb), dob, retain_graph=True), 50),
                        ("bwd_2k_causal_triton", lambda: torch.autograd.grad(
                            big["triton"], (qb, kb, vb), dob, retain_graph=True), 50),
                        ("decode_run", lambda: w.run(qd, cache), 200)):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        for order in ("cumtime", "tottime"):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(order).print_stats(30)
            print(f"== cProfile {name} ({n} calls, by {order})\n" + s.getvalue())
    if a.graph:
        dims = tuple(int(x) for x in a.graph_dims.split(","))
        modes = tuple(a.graph_modes.split(","))
        res["graph_vs_eager_ms"] = {s: graph_vs_eager(s, a.graph_backend, dims, modes) for s in
                                    (int(x) for x in a.graph_seqlens.split(","))}
    if a.json:
        env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=__import__("triton").__version__,
                   date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        with open(a.json, "w") as f:
            json.dump({"env": env, "host_us_per_call": res}, f, indent=1)


def graph_vs_eager(s: int = 2048, backend: str = "auto", dims=(64, 128, 256),
                   modes=("fwd", "bwd")) -> dict:
    """FA-grid cells at seqlen s (16k tokens, hidden 2048), bf16, forward (no grad) and backward
    (autograd.grad on a kept graph): median ms under do_bench (the benchmark's timer: a cache
    flush, then the call, host time included wherever the GPU waits for it) and under
    CUDA-graph replays (kernel time only: ``_replay_ms``), for ioattn (``backend``) and
    SDPA-cuDNN, at head dims ``dims``, for ``modes`` ("fwd", "bwd"). The inputs are drawn on the
    CPU: a capture that fails leaves the CUDA generator unusable (session 38: "Offset increment
    outside graph capture" at the next cell's torch.randn after a backward capture failed)."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    out = {}
    for d in dims:
        b, h = 16384 // s, 2048 // d
        for causal in (False, True):
            q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16).cuda().requires_grad_()
                       for _ in range(3))
            dout = torch.randn(q.shape, dtype=q.dtype).cuda()
            qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            impls = {
                ("ioattn" if backend == "auto" else f"ioattn_{backend}"): (
                    lambda: ioattn.flash_attn_func(q, k, v, causal=causal, backend=backend),
                    (q, k, v), dout),
                "cudnn": (lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                          (qt, kt, vt), dout.transpose(1, 2)),
            }
            for name, (fwd, leaves, g) in impls.items():
                ctx = (torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
                       if name == "cudnn" else contextlib.nullcontext())
                with ctx:
                    cell = f"d{d} {'C' if causal else 'N'} {name}"
                    side = torch.cuda.Stream()
                    o = fwd()
                    with torch.cuda.stream(side):  # the graphs' forward, on their stream:
                        o_side = fwd()  # autograd runs a backward op on its forward's stream
                    side.synchronize()
                    for mode, fn, fn_side in (
                            ("fwd", lambda: _no_grad(fwd), lambda: _no_grad(fwd)),
                            ("bwd", lambda: torch.autograd.grad(o, leaves, g, retain_graph=True),
                             lambda: torch.autograd.grad(o_side, leaves, g, retain_graph=True))):
                        if mode not in modes:
                            continue
                        row = {"eager": round(do_bench(fn, return_mode="median"), 4)}
                        try:
                            row["graph"] = round(_replay_ms(fn_side, side), 4)
                        except Exception as e:  # a capture failure is a finding, not a stop
                            row["graph"] = f"{type(e).__name__}: {str(e)[:120]}"
                        out[f"{mode} {cell}"] = row
                        print(f"{mode} {cell} s={s}: {row}", flush=True)
            del q, k, v, qt, kt, vt, o, o_side
            torch.cuda.empty_cache()
    return out


def _replay_ms(fn, stream, calls: int = 20, reps: int = 10) -> float:
    """Median ms per call of ``calls`` calls of fn captured in one CUDA graph on ``stream`` and
    replayed ``reps`` times (the L2 is not flushed between the calls of a replay)."""
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
        graph.replay()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def _no_grad(fn):
    with torch.no_grad():
        return fn()


if __name__ == "__main__":
    main()

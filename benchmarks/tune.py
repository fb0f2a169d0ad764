"""Sweep tile configs of the portable Triton kernels on the GPU at hand (H200), FA-grid shapes.
(--mode fwd-fp8: the fp8 forward's configs, configs.fwd_config_for(fp8=True); --mode
fwd-fp8-sm90: the sm90 fp8 forward's launch forms, sm90_fwd._fp8_form, cuDNN's bf16 beside.)

Prints TFLOP/s per config next to SDPA cuDNN/FLASH for the same shape; the winners go into
ioattn/dense/configs.py by hand, with the run logged in benchmarks/NOTES.md.

    python benchmarks/tune.py --mode fwd --dims 64,128,256 --seqlens 4096,16384
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import ioattn
from ioattn.dense import configs
from ioattn.dense.configs import BwdConfig, FwdConfig

# Candidates for the next H200 sweep, screened on CPU with `python -m ioattn.dense.inspect`-style
# compiles (spill counts in benchmarks/NOTES.md).
FWD_CANDIDATES = {
    64: [FwdConfig(128, 64, 4, 3), FwdConfig(64, 64, 4, 3), FwdConfig(128, 64, 4, 3, tma=True)],
    128: [FwdConfig(128, 64, 8, 3), FwdConfig(128, 128, 8, 3, tma=True, warp_specialize=True),
          FwdConfig(128, 64, 8, 3, tma=True), FwdConfig(128, 128, 8, 3, tma=True),
          FwdConfig(128, 64, 8, 4), FwdConfig(128, 128, 8, 3), FwdConfig(64, 64, 4, 3)],
    256: [FwdConfig(128, 64, 8, 2), FwdConfig(128, 64, 8, 1, tma=True)],
}

# the fp8 forward (--mode fwd-fp8; K / V tiles half bf16's bytes, so larger key blocks and
# TMA rings fit). Screened on CPU (sm90 compiles, keys-innermost V with block descales): these
# compile spill-free but d=256 128x64 (220 B non-causal, as bf16's 84 B); dropped for spills of
# 0.5-1.2 KB: d=64 128x128 w4, d=256 64x64 w4 and 128x128 w8.
FWD_FP8_CANDIDATES = {
    64: [FwdConfig(128, 64, 4, 3), FwdConfig(128, 64, 4, 3, tma=True),
         FwdConfig(128, 128, 8, 3, tma=True, warp_specialize=True)],
    128: [FwdConfig(128, 64, 8, 3), FwdConfig(128, 128, 8, 3),
          FwdConfig(128, 128, 8, 3, tma=True, warp_specialize=True),
          FwdConfig(128, 64, 8, 3, tma=True, warp_specialize=True),
          FwdConfig(128, 128, 8, 4, tma=True, warp_specialize=True)],
    256: [FwdConfig(128, 64, 8, 2), FwdConfig(128, 64, 8, 3)],
}

# the sm90 fp8 forward (--mode fwd-fp8-sm90): overrides of ``sm90_fwd._fp8_form``, {} its
# default (per-head descales, the form the sm90 fp8 forward covers)
FWD_FP8_SM90_CANDIDATES = {
    64: [{}, dict(PINGPONG=True)],
    128: [{}, dict(PINGPONG=True)],
    256: [{}, dict(PINGPONG=False)],
}

BWD_CANDIDATES = {
    64: [BwdConfig(64, 64, 64, 64, 4, 3), BwdConfig(64, 64, 64, 64, 4, 3, tma=True)],
    128: [BwdConfig(64, 128, 128, 64, 8, 3), BwdConfig(64, 128, 128, 64, 8, 3, tma=True),
          BwdConfig(32, 128, 128, 64, 8, 3, keys_as_b=True, tma=True),
          BwdConfig(32, 64, 64, 64, 8, 3), BwdConfig(32, 64, 64, 64, 8, 3, tma=True)],
    256: [BwdConfig(32, 64, 64, 32, 8, 2), BwdConfig(16, 64, 64, 64, 8, 2, tma=True),
          BwdConfig(16, 64, 64, 32, 8, 2, tma=True)],
}


def flops(b, h, s, d, causal, mode):
    f = 4 * b * h * s * s * d / (2 if causal else 1)
    return f * (2.5 if mode == "bwd" else 1.0)


def bench_case(mode, d, s, causal, tokens=16384, hidden=2048):
    """mode 'fwd', 'bwd', or 'fwd-fp8' (the fp8 forward on the cell's bf16 data quantized by
    ioattn.fp8.quantize_qkv: block descales, keys-innermost V; the anchors run the bf16 data)."""
    b, h = tokens // s, hidden // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    results = []
    if mode == "fwd-fp8-sm90":  # (the sm90 fp8 forms, then the anchors below but Flex)
        results = _fp8_sm90_case(q.detach(), k.detach(), v.detach(), b, h, s, d, causal)
        mode, cands = "fwd", []
    else:
        cands = {"fwd": FWD_CANDIDATES, "fwd-fp8": FWD_FP8_CANDIDATES,
                 "bwd": BWD_CANDIDATES}[mode][d]
    fwd_args, fwd_kw = (q, k, v), {}
    if mode == "fwd-fp8":
        from ioattn.fp8 import quantize_qkv

        q8, k8, v8, qd, kd, vd = quantize_qkv(q.detach(), k.detach(), v.detach())
        fwd_args, fwd_kw = (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)
        mode = "fwd"
    orig_f, orig_b = configs.fwd_config, configs.bwd_config
    for cfg in cands:
        if mode == "fwd":
            configs.fwd_config = lambda *a, _c=cfg: _c
        else:
            configs.bwd_config = lambda *a, _c=cfg: _c
        try:
            if mode == "fwd":
                ms = do_bench(lambda: ioattn.flash_attn_func(*fwd_args, causal=causal, **fwd_kw),
                              return_mode="median")
            else:
                out = ioattn.flash_attn_func(q, k, v, causal=causal)
                g = torch.randn_like(out)
                ms = do_bench(lambda: out.backward(g, retain_graph=True), grad_to_none=[q, k, v],
                              return_mode="median")
            results.append(dict(cfg=dataclasses.asdict(cfg), ms=ms,
                                tflops=flops(b, h, s, d, causal, mode) / ms * 1e-9))
        except Exception as e:  # a config that does not compile (shared memory) is reported
            results.append(dict(cfg=dataclasses.asdict(cfg), error=str(e).splitlines()[0][:120]))
        finally:
            configs.fwd_config, configs.bwd_config = orig_f, orig_b
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                if mode == "fwd":
                    ms = do_bench(fn, return_mode="median")
                else:
                    o = fn()
                    g = torch.randn_like(o)
                    ms = do_bench(lambda: o.backward(g, retain_graph=True), grad_to_none=[qt, kt, vt],
                                  return_mode="median")
            results.append(dict(anchor=name, ms=ms, tflops=flops(b, h, s, d, causal, mode) / ms * 1e-9))
        except RuntimeError as e:
            results.append(dict(anchor=name, error=str(e).splitlines()[0][:120]))
    if not cands:  # (fwd-fp8-sm90: each cell's Flex compile would take most of a device call)
        return results
    results.append(_flex(mode, qt, kt, vt, s, causal, flops(b, h, s, d, causal, mode)))
    return results


def _fp8_sm90_case(q, k, v, b, h, s, d, causal):
    """The sm90 fp8 forward's candidate forms (per-head descales, keys-innermost V) on the
    cell's data quantized (``bench_case`` times cuDNN and FA2 on the bf16 data beside)."""
    from ioattn.dense import sm90_fwd
    from ioattn.fp8 import quantize_qkv

    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, block_size=None)
    nflops = flops(b, h, s, d, causal, "fwd")
    results = []
    orig_form, orig_on = sm90_fwd._fp8_form, sm90_fwd.FP8_ON
    sm90_fwd.FP8_ON = True
    try:
        for over in FWD_FP8_SM90_CANDIDATES[d]:
            # (the launcher calls _fp8_form(d, varlen): pass its other arguments through)
            sm90_fwd._fp8_form = lambda d_, *a, _o=over, **kw: dict(orig_form(d_, *a, **kw), **_o)
            form = sm90_fwd._fp8_form(d)
            try:
                ms = do_bench(lambda: ioattn.flash_attn_func(
                    q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                    backend="sm90"), return_mode="median")
                results.append(dict(form=form, ms=ms, tflops=nflops / ms * 1e-9))
            except Exception as e:
                results.append(dict(form=form, error=str(e).splitlines()[0][:120]))
    finally:
        sm90_fwd._fp8_form, sm90_fwd.FP8_ON = orig_form, orig_on
    return results


def _flex(mode, q, k, v, s, causal, nflops):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    mask = None
    if causal:
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s, device="cuda")
    fn = torch.compile(flex_attention, dynamic=False)
    if mode == "fwd":
        ms = do_bench(lambda: fn(q, k, v, block_mask=mask), return_mode="median")
    else:
        o = fn(q, k, v, block_mask=mask)
        g = torch.randn_like(o)
        ms = do_bench(lambda: o.backward(g, retain_graph=True), grad_to_none=[q, k, v],
                      return_mode="median")
    return dict(anchor="flex", ms=ms, tflops=nflops / ms * 1e-9)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="fwd", choices=["fwd", "bwd", "fwd-fp8", "fwd-fp8-sm90"])
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--causal", default="both")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[a.causal]
    allres = []
    for d in map(int, a.dims.split(",")):
        for s in map(int, a.seqlens.split(",")):
            for causal in causals:
                res = bench_case(a.mode, d, s, causal)
                allres.append(dict(mode=a.mode, d=d, s=s, causal=causal, results=res))
                print(f"== {a.mode} d={d} s={s} causal={causal}")
                for r in res:
                    if "form" in r:  # (fwd-fp8-sm90)
                        f = r["form"]
                        name = (f"128x{f['BLOCK_N']} stages {f['STAGES']} pingpong "
                                f"{int(f['PINGPONG'])}")
                        val = f"{r['tflops']:7.1f} TFLOP/s" if "tflops" in r else "ERR " + r["error"]
                        print(f"   {name:45s} {val}")
                        continue
                    name = r.get("anchor") or "{block_m}x{block_n} w{num_warps} s{num_stages}".format(**r["cfg"]) + \
                        (" tma" if r.get("cfg", {}).get("tma") else "") + \
                        (" ws" if r.get("cfg", {}).get("warp_specialize") else "") + \
                        (" bm_dq{block_m_dq} bn_dq{block_n_dq}".format(**r["cfg"]) if "block_m_dq" in r.get("cfg", {}) else "") + \
                        (" kab" if r.get("cfg", {}).get("keys_as_b") else "")
                    val = f"{r['tflops']:7.1f} TFLOP/s" if "tflops" in r else "ERR " + r["error"]
                    print(f"   {name:45s} {val}")
                sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(allres, f, indent=1)


if __name__ == "__main__":
    main()

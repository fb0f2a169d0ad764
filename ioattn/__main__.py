"""``python -m ioattn {demo,bench,info}``.

demo  attention fwd+bwd on a realistic shape, checked against the reference, timed next to SDPA
      (on a CPU-only machine: the Triton interpreter on a small shape, correctness only).
bench the FlashAttention benchmark grid side by side with SDPA cuDNN / FLASH and FlexAttention;
      JSON + PNG under benchmarks/results/ (``python -m ioattn bench --help``).
info  versions, device, and which backends can run here.
"""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    # CPU-only machine: the Triton kernels run in the interpreter (must be set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _info() -> int:
    import triton

    import ioattn
    from ioattn.dispatch import sm90_unavailable_reason, triton_unavailable_reason

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"ioattn {ioattn.__version__}  torch {torch.__version__}  triton {triton.__version__}")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        print(f"device: {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs)")
    else:
        print(f"device: cpu (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})")
    reason = triton_unavailable_reason(device)
    print(f"backend triton: {'available' if reason is None else 'unavailable: ' + reason}")
    reason = sm90_unavailable_reason(device)
    print("backend sm90: " + ("available (Gluon FA3-design forward and backward, d 64/128/256 "
                              "(96/192 padded); auto picks each where it measured faster)"
                              if reason is None else "unavailable: " + reason))
    print("backend reference: available (plain PyTorch)")
    from ioattn.dispatch import ENV_SWITCHES

    print("kernel variant switches (environment; benchmarks/NOTES.md has their measurements):")
    for name, default, what in ENV_SWITCHES:
        print(f"  {name + '=' + os.environ.get(name, default):30s} {what}")
    return 0


def _demo() -> int:
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    # the interpreter's bf16 dot is broken in triton 3.6 (see tests/conftest.py): fp16 on CPU
    dtype = torch.bfloat16 if on_gpu else torch.float16
    shape = (4, 4096, 16, 16, 128) if on_gpu else (1, 128, 2, 1, 64)
    torch.manual_seed(0)
    print(f"ioattn demo on {device}: (b, s, h, h_k, d) = {shape} {dtype}, causal, fwd+bwd")
    ok = demo_check(device, dtype, shape)
    if not on_gpu:
        print("correctness only on CPU (Triton interpreter); run on a GPU for speed")
        return 0 if ok else 1
    demo_time(device, dtype, shape)
    return 0 if ok else 1


def _inputs(device, dtype, shape, batch=None):
    b, s, h, h_k, d = shape
    return [torch.randn(batch or b, s, n, d, device=device, dtype=dtype, requires_grad=True)
            for n in (h, h_k, h_k)]


def demo_check(device: torch.device, dtype: torch.dtype, shape: tuple) -> bool:
    """One sequence of the batch against the fp32 reference (FlashAttention's rule), fwd + bwd."""
    from ioattn import flash_attn_func
    from ioattn.reference import attention_ref
    from ioattn.testing import GRAD_FACTOR, OUT_FACTOR, rule_check

    q, k, v = _inputs(device, dtype, shape, batch=1)
    out = flash_attn_func(q, k, v, causal=True)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref, _ = attention_ref(q, k, v, causal=True)
    pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    ref_g = torch.autograd.grad(ref, (q, k, v), g)
    pt_g = torch.autograd.grad(pt, (q, k, v), g)
    ok = True
    for name, a, r, p, f in [("out", out, ref, pt, OUT_FACTOR)] + [
            (n, a, r, p, GRAD_FACTOR) for n, a, r, p in zip(("dq", "dk", "dv"), grads, ref_g, pt_g)]:
        good, err, base, _ = rule_check(a, r, p, f)
        ok &= good
        print(f"  {name}: max err {err:.2e} (PyTorch {dtype} err {base:.2e}) {'ok' if good else 'FAIL'}")
    return ok


def demo_time(device: torch.device, dtype: torch.dtype, shape: tuple) -> dict:
    """fwd and bwd ms of ioattn next to SDPA's cuDNN and FLASH backends (the bench's cells, MHA with
    shape's b, s, h, d); an anchor that cannot run is reported, not fatal."""
    from ioattn.bench.runner import run_cell
    from ioattn.bench.shapes import Shape

    b, s, h, _, d = shape
    key = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    impls = ["ioattn", "sdpa_cudnn", "sdpa_flash"]
    results: dict = {}
    for mode in ("fwd", "bwd"):
        for row in run_cell(Shape(mode, d, h, s, b, True, key), impls, device, 25, 100):
            if row.error:
                print(f"  {row.impl:12s} {mode} unavailable: {row.error[:100]}")
                continue
            results.setdefault(row.impl, {})[mode] = row.ms
            print(f"  {row.impl:12s} {mode} {row.ms:7.3f} ms {row.tflops:6.1f} TFLOP/s")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[0] if argv else "help"
    if cmd == "demo":
        return _demo()
    if cmd == "bench":
        from ioattn.bench.runner import main as bench_main

        return bench_main(argv[1:])
    if cmd == "info":
        return _info()
    print(__doc__)
    return 0 if cmd in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())

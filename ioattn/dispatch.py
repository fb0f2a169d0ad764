"""Backend choice. An explicitly requested backend that cannot run raises; only 'auto' picks.

- 'triton': the portable Triton kernels (any GPU with compute capability >= 8.0; CPU under the
  interpreter).
- 'sm90': the Hopper kernels written in Gluon (FlashAttention-3 design), for sm90 with Triton 3.6.x
  (Gluon's API changes between Triton releases, so other versions are refused, never guessed at).
- 'reference': plain PyTorch (slow; any device).
- 'auto': 'sm90' where the platform and the problem allow it, else 'triton'.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ioattn.dense.configs import capability, interpreting, per_device

BACKENDS = ("auto", "triton", "sm90", "reference")
# Gluon releases this code is written against (its API is experimental and changes per release)
GLUON_TRITON_SERIES = "3.6."


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None when they can)."""
    return per_device("triton", device, _triton_unavailable_reason)


def _triton_unavailable_reason(device: torch.device) -> str | None:
    if device.type == "cuda":
        major, _ = capability(device)
        if major < 8:
            return f"the Triton kernels need compute capability >= 8.0, {device} has {major}.x"
        return None
    if device.type == "cpu":
        if interpreting():
            return None
        return ("CPU tensors run only under the Triton interpreter: set TRITON_INTERPRET=1 before "
                "importing triton, or pass backend='reference'")
    return f"device type {device.type!r} is not supported (use CUDA tensors)"


def sm90_unavailable_reason(device: torch.device) -> str | None:
    """Why the Gluon Hopper kernels cannot run on ``device`` at all (None when they can)."""
    return per_device("sm90", device, _sm90_unavailable_reason)


def _sm90_unavailable_reason(device: torch.device) -> str | None:
    import triton

    if device.type != "cuda":
        return f"the sm90 kernels need a CUDA device (Hopper), got {device.type}"
    if interpreting():
        return "the sm90 kernels are Gluon, which the Triton interpreter cannot run"
    cap = capability(device)
    if cap != (9, 0):
        return f"the sm90 kernels need compute capability 9.0 (H100/H200), {device} has {cap[0]}.{cap[1]}"
    if not triton.__version__.startswith(GLUON_TRITON_SERIES):
        return (f"the sm90 kernels are written for Triton {GLUON_TRITON_SERIES}x (Gluon's API changes "
                f"between releases), this is Triton {triton.__version__}")
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the installed Triton
        return f"triton.experimental.gluon cannot be imported: {e}"
    return None


def resolve_backend(backend: str, device: torch.device,
                    sm90_problem: Optional[Callable[[], Optional[str]]] = None,
                    sm90_preferred: Optional[Callable[[], bool]] = None) -> str:
    """Map a requested backend to the one that runs: 'sm90', 'triton' or 'reference'.

    ``sm90_problem()`` says why this particular call (head dim, features, layout) is outside what
    the sm90 kernels cover, None when it is inside; it is only called where the platform can run
    them (it may import Gluon). Without it the call has no sm90 path. ``sm90_preferred()`` tells
    'auto' whether the sm90 kernel is the faster choice for this call (an explicit 'sm90' runs it
    regardless).
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "reference":
        return "reference"
    if backend in ("sm90", "auto"):
        reason = sm90_unavailable_reason(device)
        if reason is None:
            reason = sm90_problem() if sm90_problem is not None else "this entry point has no sm90 kernel"
        if reason is None and (backend == "sm90" or sm90_preferred is None or sm90_preferred()):
            return "sm90"
        if backend == "sm90":
            raise ValueError(f"backend='sm90' cannot run: {reason}; use backend='triton' or 'auto'")
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run: {reason}")
    return "triton"


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA: the interpreter's stand-in), the unit
    of the launch-shape rules (split counts, work items, persistent grids); once per device."""
    if device.type != "cuda":
        return 4
    return per_device("sm_count", device,
                      lambda dev: torch.cuda.get_device_properties(dev).multi_processor_count)


# Environment switches of kernel variants, for measurement (``python -m ioattn info`` lists them
# with their values): what each does and its default. Variants that have not measured faster
# stay off by default; benchmarks/NOTES.md records each one's measurements. Each is read once,
# when the module that uses it is imported.
ENV_SWITCHES = (
    ("IOATTN_SM90_PINGPONG", "auto", "sm90 forward: consumer warpgroups issue GEMMs in turns, "
     "round robin (auto: d=256 with two warpgroups only; 1/0 force, three warpgroups too)"),
    ("IOATTN_SM90_FWD_LPT", "1", "sm90 forward: its tiles (the dynamic scheduler's, or one CTA "
     "each) in grouped heaviest-first order (heads in groups of about a wave, each group's "
     "heaviest tiles first)"),
    ("IOATTN_SM90_BWD_LPT", "1", "sm90 backward: the dK/dV and dQ kernels' blocks in grouped "
     "heaviest-first order"),
    ("IOATTN_SM90_PERSISTENT", "auto", "sm90 forward: persistent CTAs over query tiles (batched); "
     "auto: dynamic at d=64/128, dynamic: tiles handed out by an atomic counter, 1: static "
     "snake order, 0: one CTA per tile"),
    ("IOATTN_SM90_PAD", "tma", "sm90 kernels at head dims 96 / 192 (run as 128 / 256): "
     "tma: read in place through [rows, heads, d] views the TMA unit zero-fills past d (no "
     "copies); copy: zero-padded copies of q, k, v (and dO, O)"),
    ("IOATTN_SM90_PAD_NARROW", "1", "sm90 kernels at head dims 96 / 192 read in place: QKᵀ over "
     "d's own columns (two power-of-two pieces) and V / O at d_v's own width where it is a "
     "power of two ((192, 128): PV at 128 columns, not 256); in the backward's dQ and "
     "column-split dK/dV kernels S and dP over d's / d_v's own columns"),
    ("IOATTN_SM90_SOFTCAP_APPROX", "1", "sm90 kernels: softcap's tanh on the MUFU's "
     "tanh.approx.f32 (one instruction a score, 2^-11 relative error) instead of exp2 and a "
     "fast division (0: the exact form, ~1e-7 absolute)"),
    ("IOATTN_SM90_FWD_EXP_EARLY", "auto", "sm90 forward: each key block's exponentials (and P's "
     "conversion) kept before the wait for the previous block's PV GEMM (auto: on the d=64 "
     "192x128 tile without a mask; 1: everywhere; 0: nowhere, ptxas then runs most of them "
     "after it, and the d=64 forward without a mask keeps 128x128 tiles)"),
    ("IOATTN_SM90_BWD_EXP_EARLY", "0", "sm90 backward (d<=128 dK/dV kernels): each step's exponentials "
     "kept before the wait for dP's GEMM (1: on; 0: off, ptxas then runs most of them after it)"),
    ("IOATTN_SM90_FWD_WG3", "1", "sm90 forward at d=64: three consumer warpgroups (192-row "
     "tiles)"),
    ("IOATTN_SM90_WG3_BLOCK_N", "auto", "sm90 forward on three warpgroups (d=64): keys per "
     "tile; auto: 128 (FlashAttention-3's 192x128 tile, persistent) for batched problems from "
     "2k queries without a mask and from 4k causal, else 64; 64: never 128; 128: for every "
     "d=64 forward"),
    ("IOATTN_SM90_WG3_PERSISTENT", "0", "sm90 forward at d=64: three consumer warpgroups on 64-key "
     "tiles in the persistent form too (else two there, or the 192x128 tile)"),
    ("IOATTN_SM90_BWD_DQ_ORDER", "auto", "sm90 fused backward: where each step's dQ partial is "
     "issued: after dK's update, first (before it), lag (one step late, overlapping the next "
     "step's dS), alt (d=64: one warpgroup a step, in turn, over all 128 keys); auto: alt at "
     "d=64, lag at d=128 without a mask, after under one"),
    ("IOATTN_SM90_BWD_SEGMENTS", "auto", "sm90 backward (d<=128, not the lag order): each query "
     "head's steps in three loops, the middle one without the mask's code; auto: d=64 without "
     "a causal mask or window"),
    ("IOATTN_SM90_BWD_ROW_STATS", "1", "sm90 backward dK/dV kernels: the rows' LSE and delta staged "
     "in shared memory by the producer, read just before use (0: held in registers)"),
    ("IOATTN_SM90_BWD_D256", "1", "sm90 backward at d=256: a column-split dK/dV kernel and the dQ "
     "kernel on 32-key tiles (0: the portable backward there)"),
    ("IOATTN_SM90_BWD_ROWS", "auto", "sm90 fused backward at d=64: query rows a dK/dV step, auto "
     "(128), 64 or 128 (FlashAttention-3's d <= 64 step: N = 128 score GEMMs, dQ split by rows)"),
    ("IOATTN_SM90_BWD_STAGES", "auto", "sm90 backward dK/dV kernel at d=64: Q/dO ring stages "
     "(auto: 2; 3 or 4 fit its shared memory on 64-row steps, IOATTN_SM90_BWD_ROWS=64)"),
    ("IOATTN_SM90_BWD_TMA_STORE", "1", "sm90 backward dK/dV kernel (d=64/128): dK and dV of full "
     "64-key halves staged in the freed Q/dO stage and stored by TMA (0: stored from registers)"),
    ("IOATTN_SM90_FWD_O_TMA", "1", "sm90 persistent forward: O staged in the tile's last V "
     "stage and stored by TMA (full 64-row halves; 0: stored from registers)"),
    ("IOATTN_SM90_FP8", "1", "sm90 forward on fp8 (e4m3) q, k, v: batched calls with per-head "
     "descales (FlashAttention-3's fp8 forward), 'auto' where it measured faster; 0: fp8 calls "
     "run the portable kernel"),
    ("IOATTN_SM90_FP8_BLOCK", "0", "sm90 fp8 forward with block descales (one per 128 rows, "
     "ioattn.fp8.quantize's default) too; opt-in until its GPU tests have run, such calls run "
     "the portable kernel"),
    ("IOATTN_SM90_FP8_VARLEN", "0", "sm90 fp8 forward on varlen calls (cu_seqlens) too; opt-in "
     "until its GPU tests have run, such calls run the portable kernel"),
    ("IOATTN_SM90_FP8_PERSISTENT", "0", "sm90 fp8 forward on persistent CTAs for batched calls "
     "(the dynamic scheduler, as the 16-bit forms); opt-in until timed: one CTA per tile"),
    ("IOATTN_SM90_FWD_Q_REGS", "0", "sm90 forward (d=128 / 256, 16-bit): Q's first columns in "
     "registers as Q·Kᵀ's A operand (d=128 all, exponentials early without a mask; d=256 64), "
     "the rest from shared memory; opt-in until timed"),
    ("IOATTN_SM90_FWD_O_DEFER", "1", "sm90 persistent forward (with O_TMA): the V stage holding "
     "O goes back to the producer after the next tile's first key block, not after a wait "
     "(0: waited for at the store)"),
    ("IOATTN_SM90_FWD_Q_BUFS", "auto", "sm90 persistent forward (d=64/128): Q in 1 or 2 "
     "buffers; 2 loads the next tile's Q (and its first K/V) while this tile runs (d=128: two "
     "stages then); auto: 2 up to 8192 keys (not at d=64 without a mask), 1 beyond"),
    ("IOATTN_SM90_FUSED_BWD", "1", "sm90 backward: one kernel, dQ by TMA reduce-add (0: two "
     "kernels without atomics, as deterministic=True)"),
    ("IOATTN_SM90_DECODE", "1", "planned paged decode on the sm90 Gluon kernel"),
    ("IOATTN_SM90_DECODE_FP8", "1", "sm90 decode: fp8 caches too (their tiles converted to fp16 "
     "in shared memory; 0: the portable kernel takes them)"),
    ("IOATTN_SM90_DECODE_BALANCED", "0", "planned decode: FlashInfer's balanced split (equal runs "
     "of key tiles, one sm90 CTA per run and KV head looping over its pieces)"),
    ("IOATTN_SM90_DECODE_CLAIM", "1", "sm90 decode on a graph's bound grid: CTAs claim their "
     "(item, KV head) units SM by SM when the work fits one an SM (0: grid positions)"),
    ("IOATTN_SM90_DECODE_CLAIM_SPREAD", "1", "sm90 decode claims: only the first CTAs on an "
     "even subset of SM ids, one per unit, claim at once (the units spread over the GPCs; 0: "
     "first come, first served)"),
    ("IOATTN_SM90_DECODE_LOADER", "tma", "sm90 decode (bf16 / fp16, one item a CTA): the "
     "producer fills the ring by TMA, or by cp.async with a producer warpgroup (cpasync)"),
    ("IOATTN_SM90_DECODE_ROWS_AHEAD", "1", "sm90 decode: the TMA producer loads each key "
     "tile's page-table entries a tile ahead, before waiting for the tile's stage"),
    ("IOATTN_SM90_DECODE_SHALLOW", "1", "sm90 decode (bf16 / fp16, one item a CTA): two key "
     "tiles in flight a CTA, not the ring's three, when the work's units outnumber the SMs"),
    ("IOATTN_SM90_DECODE_MMA16", "0", "sm90 decode: GQA groups of at most 16 query heads on "
     "mma.sync (16 rows, each consumer warp on its own keys) instead of a 64-row wgmma tile"),
    ("IOATTN_SM90_DECODE_EARLY", "1", "sm90 decode (one item a CTA): the item read before PDL's "
     "wait, L2 prefetches from the first wave of CTAs only (fewer dependent loads at a CTA's start)"),
    ("IOATTN_BIND", "1", "portable forward and backward (batched, no ALiBi / dropout): a "
     "repeat of a call's signature launched in one C call a kernel, past the launcher's signature"),
    ("IOATTN_SM90_FWD_BIND", "1", "sm90 forward: a repeat of a call's form launched in one C "
     "call (descriptors encoded at the call's addresses), past the launcher's signature"),
    ("IOATTN_SM90_BWD_BIND", "1", "sm90 backward (batched): a repeat of the op's signature "
     "launched in one C call a kernel (descriptors encoded at the call's addresses), past the "
     "launch rules (with IOATTN_BIND, which supplies the signature)"),
    ("IOATTN_SM90_FWD_STREAM_COUNTERS", "1", "sm90 persistent forward: the dynamic scheduler's "
     "tile counter kept per stream and zeroed by each launch's last CTA, not allocated and "
     "zeroed by the host per call"),
    ("IOATTN_SM90_DECODE_D256", "1", "sm90 decode at head dim 256 too (one CTA an SM, 232 "
     "registers a thread); off: the portable kernel serves it"),
    ("IOATTN_SM90_DECODE_MERGE", "1", "sm90 decode: split requests merged in the kernel by "
     "their last item (no combine launch)"),
    ("IOATTN_SM90_DECODE_PDL", "1", "sm90 decode: programmatic dependent launch (its CTAs start "
     "while the previous kernel finishes, and wait for it before touching memory)"),
    ("IOATTN_SM90_DECODE_PREFETCH", "1", "sm90 decode (with PDL): L2 prefetches of each CTA's "
     "first key tiles before its wait for the previous kernel"),
    ("IOATTN_SM90_DECODE_HEADS_FIRST", "1", "sm90 decode: the grid as (KV heads, items), one "
     "item's heads side by side (they read the same cache rows)"),
)


"""The sm90 forward's polynomial exponential (``sm90_common.exp2_poly``, opt-in with
IOATTN_SM90_EXP_POLY): its algorithm replayed in fp32 PyTorch with the kernel's constants (the
Gluon function itself cannot run on CPU; the GPU tests run it in the kernel), and the compiled
kernel's MUFU.EX2 count dropping where it is switched on."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from ioattn.dense import sm90_common as c


def _exp2_poly_fp32(x: torch.Tensor) -> torch.Tensor:
    rnd = torch.tensor(c.EXP2_ROUND.value, dtype=torch.float32)
    t = x + rnd
    f = x - (t - rnd)
    p = c.EXP2_C3.value * f + c.EXP2_C2.value
    p = p * f + c.EXP2_C1.value
    p = p * f + c.EXP2_C0.value
    p = p.float()
    bits = p.view(torch.int32) + (t.view(torch.int32) << 23)
    return torch.where(x < -126.0, torch.zeros_like(x), bits.view(torch.float32))


def test_exp2_poly_accuracy():
    # (at exactly x = -126 the exponent field reaches 0 and the result loses bits, 1.4e-4: far
    # below anything a softmax sum notices; below -126 it is 0)
    x = torch.cat([torch.linspace(-125.0, 0.0, 200_001), -torch.rand(100_000) * 30.0,
                   torch.tensor([0.0, -0.5, -1.5, -124.99])]).float()
    got = _exp2_poly_fp32(x).double()
    want = torch.exp2(x.double())
    rel = ((got - want).abs() / want).max().item()
    assert rel < 8e-5, rel  # bf16 P keeps 8 bits (3.9e-3)
    assert (got[x <= 0] <= 1.0).all()


def test_exp2_poly_zero_below_range():
    x = torch.tensor([float("-inf"), -1e30, -127.0, -126.5], dtype=torch.float32)
    assert torch.equal(_exp2_poly_fp32(x), torch.zeros(4))  # fully masked rows need exact 0


_COMPILE = """
import json
from ioattn.dense import inspect as ins, sm90_fwd
out = {}
for poly in (0, 0b111):
    bn, stages, regs = sm90_fwd._tile(64, 3)
    ce = dict(IS_VARLEN=False, HAS_LEFT=False, HAS_RIGHT=False, CONSUMER_REGS_=regs,
              PRODUCER_REGS_=sm90_fwd.PRODUCER_REGS, STAGES=stages, BLOCK_N=bn, PAGED=False,
              PAGE=1, PINGPONG=False, PERSISTENT=False, WGS=3, EXP_POLY=poly)
    fn = sm90_fwd._attn_fwd_sm90
    sig = ins._gluon_signature(fn, "bf16", dict(q_desc=64, o_desc=64, k_desc=bn, v_desc=bn), 64)
    r = ins.gluon_report(f"poly{poly}", fn, sig, ce)
    out[poly] = dict(mufu=r.sass["MUFU"], spills=r.spill_stores)
print(json.dumps(out))
"""


def test_poly_forward_compiles_without_mufu_exponentials():
    """All consumer warpgroups on the polynomial (d=64, three warpgroups): MUFU.EX2 drops to the
    few rescale exponentials, spill-free. Compiled for sm90 in a subprocess (Gluon does not run
    under the interpreter the tests set)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    base, poly = out["0"], out[str(0b111)]
    assert poly["spills"] == 0 and base["spills"] == 0
    assert poly["mufu"] * 4 < base["mufu"], out

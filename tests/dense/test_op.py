"""torch.library integration: opcheck on the ops, torch.compile(fullgraph=True) without graph breaks."""
import pytest
import torch

import ioattn
from ioattn.dense.op import dense_bwd, dense_fwd, draw_rng_state
from ioattn.testing import cu_seqlens
from tests.conftest import ON_GPU

# under the interpreter a compiled graph only needs to trace: aot_eager proves there is no break
BACKEND = "inductor" if ON_GPU else "aot_eager"


def _fwd_args(device, varlen=False, dropout=0.0):
    h, h_k, d = 4, 2, 32
    if varlen:
        lens = [5, 0, 17]
        cu = cu_seqlens(lens, device)
        q = torch.randn(sum(lens), h, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(sum(lens), h_k, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(sum(lens), h_k, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        cus, ms = (cu, cu), (17, 17)
    else:
        q = torch.randn(2, 19, h, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 23, h_k, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 23, h_k, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        cus, ms = (None, None), (19, 23)
    rng = draw_rng_state(device) if dropout else None
    return (q, k, v, *cus, *ms, 0.2, -1, 0, 0.0, None, dropout, rng)


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_opcheck_fwd(varlen, device):
    torch.library.opcheck(dense_fwd, _fwd_args(device, varlen))


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_opcheck_bwd(varlen, device):
    args = _fwd_args(device, varlen)
    q, k, v = (t.detach() for t in args[:3])
    out, lse = dense_fwd(q, k, v, *args[3:])
    dout = torch.randn_like(out)
    torch.library.opcheck(dense_bwd, (dout, q, k, v, out, lse, None, *args[3:]),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


class TinyAttentionBlock(torch.nn.Module):
    def __init__(self, dim=64, heads=4, kv_heads=2, dropout_p=0.0):
        super().__init__()
        self.dropout_p = dropout_p
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.proj = torch.nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.heads + 2 * self.kv_heads, self.hd)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        o, lse, _ = ioattn.flash_attn_func(q, k, v, causal=True, softcap=20.0, dropout_p=self.dropout_p,
                                           return_attn_probs=True)
        return self.proj(o.reshape(b, s, -1)) + lse.mean()


def test_compile_fullgraph_model(device):
    torch._dynamo.reset()
    model = TinyAttentionBlock().to(device=device, dtype=torch.bfloat16)
    x = torch.randn(2, 33, 64, device=device, dtype=torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    y = compiled(x)
    y.float().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y_eager = model(x)
    y_eager.float().sum().backward()
    torch.testing.assert_close(y, y_eager, atol=2e-2, rtol=2e-2)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=5e-2, rtol=5e-2)


def test_compile_fullgraph_dropout(device):
    """Dropout draws its Philox seed inside the graph (inductor's RNG differs from eager's, so only
    the absence of graph breaks and finite gradients are checked here; dropout numerics are in
    test_dropout.py)."""
    torch._dynamo.reset()
    model = TinyAttentionBlock(dropout_p=0.1).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(2, 33, 64, device=device, dtype=torch.bfloat16)
    y = torch.compile(model, fullgraph=True, backend=BACKEND)(x)
    y.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_compile_fullgraph_varlen(device):
    torch._dynamo.reset()
    args = _fwd_args(device, varlen=True)
    q, k, v, cq, ck = args[:5]

    def f(q, k, v):
        return ioattn.flash_attn_varlen_func(q, k, v, cq, ck, 17, 17, causal=True).float().sum()

    loss = torch.compile(f, fullgraph=True, backend=BACKEND)(q, k, v)
    loss.backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_eager_calls_keep_the_ops_visible_where_it_matters(device):
    """Eager calls run the ops' implementations directly (the dispatcher's host time), but a
    dispatch mode (selective activation checkpointing, FlopCounterMode, make_fx) still sees
    ``ioattn::dense_fwd`` / ``dense_bwd``; compiled autograd traces the eager forward's
    backward; and create_graph=True through attention fails clearly rather than dropping the
    second-order term."""
    from torch._dynamo import compiled_autograd
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k, v = (torch.randn(1, 33, 2, 64, device=device, dtype=torch.float16, requires_grad=True)
               for _ in range(3))

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log() as log:
        ioattn.flash_attn_func(q, k, v, causal=True).float().sum().backward()
    assert [o for o in log.ops if "ioattn" in o] == ["ioattn.dense_fwd.default",
                                                     "ioattn.dense_bwd.default"]

    grads = torch.autograd.grad(ioattn.flash_attn_func(q, k, v, causal=True).float().sum(),
                                (q, k, v))
    for t in (q, k, v):
        t.grad = None
    out = ioattn.flash_attn_func(q, k, v, causal=True)
    torch._dynamo.reset()
    with compiled_autograd._enable(lambda gm: torch.compile(gm, backend=BACKEND, fullgraph=True)):
        out.float().sum().backward()
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(t.grad, g)

    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(ioattn.flash_attn_func(q, k, v).float().sum(), (q,), create_graph=True)

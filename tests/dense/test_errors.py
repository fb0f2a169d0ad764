"""Bad input gets a clear error naming the argument, before any kernel runs."""
import pytest
import torch

import ioattn
from ioattn.testing import cu_seqlens


def _qkv(device, b=2, s=16, h=4, h_k=4, d=32, dtype=torch.bfloat16):
    return (torch.randn(b, s, h, d, device=device, dtype=dtype),
            torch.randn(b, s, h_k, d, device=device, dtype=dtype),
            torch.randn(b, s, h_k, d, device=device, dtype=dtype))


def test_dtype_errors(device):
    q, k, v = _qkv(device)
    with pytest.raises(TypeError, match="q has dtype torch.float32"):
        ioattn.flash_attn_func(q.float(), k, v)
    with pytest.raises(TypeError, match="k has dtype torch.float16"):
        ioattn.flash_attn_func(q, k.half(), v)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        ioattn.flash_attn_func(q.tolist(), k, v)


def test_shape_errors(device):
    q, k, v = _qkv(device)
    with pytest.raises(ValueError, match="q must have 4 dims"):
        ioattn.flash_attn_func(q[0], k, v)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        ioattn.flash_attn_func(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="head dim 288 is not supported"):
        big = torch.randn(1, 4, 1, 288, device=device, dtype=torch.bfloat16)
        ioattn.flash_attn_func(big, big, big)
    with pytest.raises(ValueError, match="k head dim 16 != q head dim 32"):
        ioattn.flash_attn_func(q, k[..., :16], v)
    with pytest.raises(ValueError, match="batch sizes differ"):
        ioattn.flash_attn_func(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="k has seqlen 16 but v has 8"):
        ioattn.flash_attn_func(q, k, v[:, :8])
    with pytest.raises(ValueError, match="v has 2 heads but k has 4"):
        ioattn.flash_attn_func(q, k, v[:, :, :2])


def test_argument_errors(device):
    q, k, v = _qkv(device)
    with pytest.raises(ValueError, match="dropout_p"):
        ioattn.flash_attn_func(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="window_size"):
        ioattn.flash_attn_func(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softmax_scale"):
        ioattn.flash_attn_func(q, k, v, softmax_scale=0.0)
    with pytest.raises(ValueError, match="softcap"):
        ioattn.flash_attn_func(q, k, v, softcap=-1.0)
    with pytest.raises(TypeError, match="alibi_slopes must be float32"):
        ioattn.flash_attn_func(q, k, v, alibi_slopes=torch.ones(4, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="alibi_slopes has shape"):
        ioattn.flash_attn_func(q, k, v, alibi_slopes=torch.ones(3, device=device))
    with pytest.raises(ValueError, match="backend="):
        ioattn.flash_attn_func(q, k, v, backend="cudnn")


def test_errors_after_a_valid_call_of_the_same_signature(device):
    """flash_attn_func keeps each valid signature's checks and pick (api._PLANS): arguments that
    compare equal to a valid call's but are rejected on their own (float windows, numpy scalars)
    must still be rejected after it."""
    np = pytest.importorskip("numpy")
    q, k, v = _qkv(device)
    ioattn.flash_attn_func(q, k, v)  # valid: its plan is kept
    with pytest.raises(ValueError, match="window_size"):
        ioattn.flash_attn_func(q, k, v, window_size=(-1.0, -1.0))
    with pytest.raises(ValueError, match="softcap"):
        ioattn.flash_attn_func(q, k, v, softcap=np.float32(0.0))
    with pytest.raises(ValueError, match="softmax_scale"):
        ioattn.flash_attn_func(q, k, v, softmax_scale=np.float32(32 ** -0.5))
    ioattn.flash_attn_func(q, k, v, softmax_scale=32 ** -0.5)
    with pytest.raises(ValueError, match="softmax_scale"):
        ioattn.flash_attn_func(q, k, v, softmax_scale=np.float32(32 ** -0.5))


def test_device_errors(device):
    q, k, v = _qkv(device)
    other = "meta"
    with pytest.raises(ValueError, match="k is on meta"):
        ioattn.flash_attn_func(q, k.to(other), v)


def test_cpu_without_interpreter(monkeypatch):
    q, k, v = _qkv("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ioattn.flash_attn_func(q, k, v)
    # the reference backend runs anywhere and is an explicit choice
    out = ioattn.flash_attn_func(q, k, v, backend="reference")
    assert out.shape == q.shape


def test_cu_seqlens_errors(device):
    h, d = 2, 32
    q = torch.randn(30, h, d, device=device, dtype=torch.bfloat16)
    cu = cu_seqlens([10, 20], device)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        ioattn.flash_attn_varlen_func(q, q, q, cu.long(), cu, 20, 20)
    with pytest.raises(ValueError, match="non-decreasing"):
        bad = torch.tensor([0, 20, 10], dtype=torch.int32, device=device)
        ioattn.flash_attn_varlen_func(q, q, q, bad, cu, 20, 20)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must have shape \(3,\)"):
        ioattn.flash_attn_varlen_func(q, q, q, cu, cu[:2], 20, 20)
    with pytest.raises(ValueError, match="exceeds the 30 rows"):
        ioattn.flash_attn_varlen_func(q, q, q, cu + torch.tensor([0, 0, 5], dtype=torch.int32,
                                                                 device=device), cu, 25, 20)
    with pytest.raises(ValueError, match="max_seqlen"):
        ioattn.flash_attn_varlen_func(q, q, q, cu, cu, 10, 20)
    with pytest.raises(ValueError, match="q must have 3 dims"):
        ioattn.flash_attn_varlen_func(q[None], q, q, cu, cu, 20, 20)
    # values are checked once per state of the tensor: an in-place update is checked again
    ok = cu.clone()
    ioattn.flash_attn_varlen_func(q, q, q, ok, ok, 20, 20)
    ok[2] = 5
    with pytest.raises(ValueError, match="non-decreasing"):
        ioattn.flash_attn_varlen_func(q, q, q, ok, ok, 20, 20)


def test_int32_row_extent_error():
    """A sequence spanning >= 2^31 elements raises (checked on the op's inputs, no kernel runs)."""
    from ioattn.dense.params import check_int32_rows

    q = torch.empty(2**20, 2, 8, device="meta").as_strided((2**20, 2, 8), (2**12, 8, 1))  # no storage
    with pytest.raises(ValueError, match="int32 in-sequence indexing"):
        check_int32_rows(2**20, q=q)
    check_int32_rows(2**10, q=q)  # small extent passes

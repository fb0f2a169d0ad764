"""The chunked-prefill path of flash_attn_with_kvcache: keys gathered out of the cache into packed
K/V, then the dense varlen forward (``ioattn.decode.op.gathers`` picks it on GPUs for long query
chunks; ``FORCE_GATHER`` runs it here at small shapes under the interpreter)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ioattn
from ioattn.decode import op
from ioattn.decode.triton_decode import gather_kv
from tests.conftest import ON_GPU
from tests.decode.test_kvcache import BF16, FP16, KVCase, _build, check_against_ref

GATHER_CASES = [
    KVCase(b=3, s_q=20, h=4, h_k=2, page=1, causal=True, empty_seq=True, capacity=60),
    # chunked prefill proper: the query tokens are the new ones (rotated at their positions)
    KVCase(b=3, s_q=19, h=6, h_k=2, page=3, causal=True, leftpad=True, s_new=19,
           rotary="interleaved", capacity=100),
    KVCase(b=4, s_q=20, h=8, h_k=2, page=16, window=(30, 4), empty_seq=True),
    KVCase(b=3, s_q=17, h=4, h_k=1, page=None, causal=True, leftpad=True, s_new=17,
           rotary="halves", dtype=FP16, capacity=80),
    KVCase(b=2, s_q=16, h=4, h_k=2, page=4, causal=True, s_new=3, capacity=50),
    KVCase(b=3, s_q=20, h=4, h_k=4, page=None, batch_idx=True, window=(40, 0), empty_seq=True,
           capacity=120),
    KVCase(b=2, s_q=12, h=4, h_k=2, page=16, softcap=3.0, alibi="batch", leftpad=True,
           capacity=70),
    # not causal, queries outnumbering some sequences' keys; a head dim the tiles pad
    KVCase(b=3, s_q=20, h=3, h_k=1, d=40, page=5, capacity=200, dtype=FP16),
]
if ON_GPU:
    GATHER_CASES += [
        KVCase(b=3, s_q=256, h=32, h_k=8, d=128, page=16, capacity=2048, causal=True, s_new=256,
               empty_seq=True),
        KVCase(b=2, s_q=512, h=16, h_k=2, d=128, page=None, capacity=3000, window=(700, 0),
               leftpad=True, s_new=512, rotary="halves"),
        KVCase(b=2, s_q=2048, h=8, h_k=8, d=128, page=64, capacity=4096),
        KVCase(b=2, s_q=256, h=16, h_k=4, d=256, page=16, capacity=1024, causal=True,
               softcap=5.0, alibi="batch"),
    ]


@pytest.mark.parametrize("c", GATHER_CASES, ids=lambda c: c.id)
def test_gathered(c: KVCase, device, monkeypatch):
    monkeypatch.setattr(op, "FORCE_GATHER", True)
    monkeypatch.setattr(op, "FORCE_SM90_PAGED", False)  # (on Hopper it would come first)
    check_against_ref(c, device)


@pytest.mark.parametrize("page", [1, 3, None], ids=["page1", "page3", "contig-batchidx"])
def test_gather_kv_packs_and_zero_fills(page, device):
    """Packed rows hold each sequence's keys [leftpad, seqlen) in order, cu_k their prefix sums;
    the rows past the last key are written with zeros (the buffers start as NaN here); an fp8
    cache is upcast exactly."""
    c = KVCase(b=4, h_k=2, page=page, leftpad=True, empty_seq=True, batch_idx=page is None,
               capacity=40)
    _, k_cache, v_cache, kw, _ = _build(c, device)
    k_cache, v_cache = (t.to(torch.float8_e4m3fn) for t in (k_cache, v_cache))
    table, batch_idx = kw["block_table"], kw["cache_batch_idx"]
    lens, pads = kw["cache_seqlens"].long(), kw["cache_leftpad"].long()
    capacity = table.shape[1] * page if page else k_cache.shape[1]
    k_out = torch.full((c.b * capacity, c.h_k, c.d), float("nan"), dtype=BF16, device=device)
    v_out = torch.full_like(k_out, float("nan"))
    cu_k = torch.full((c.b + 1,), -7, dtype=torch.int32, device=device)
    gather_kv(k_cache, v_cache, kw["cache_seqlens"], kw["cache_leftpad"], table, batch_idx,
              k_out, v_out, cu_k)
    want_cu = torch.cat([lens.new_zeros(1), (lens - pads).cumsum(0)])
    assert cu_k.long().tolist() == want_cu.tolist()
    for i in range(c.b):
        pos = torch.arange(int(pads[i]), int(lens[i]), device=device)
        if page:
            pg, slot = table[i].long()[pos // page], pos % page
        else:
            pg, slot = torch.full_like(pos, int(batch_idx[i])), pos
        rows = slice(int(want_cu[i]), int(want_cu[i + 1]))
        assert torch.equal(k_out[rows], k_cache[pg, slot].to(BF16))
        assert torch.equal(v_out[rows], v_cache[pg, slot].to(BF16))
    total = int(want_cu[-1])
    assert total < k_out.shape[0] and (k_out[total:] == 0).all() and (v_out[total:] == 0).all()



def _meta_q(b, s_q, h, d=128, cuda=True):
    # the rule reads q's shape, strides, size, dtype width and device
    t = torch.empty(b, s_q, h, d, dtype=BF16, device="meta")
    return SimpleNamespace(shape=t.shape, is_cuda=cuda, numel=t.numel, stride=t.stride,
                           element_size=t.element_size,
                           device=torch.device("cuda" if cuda else "cpu"))


def test_gather_rule(monkeypatch):
    """``gathers``: the measured chunked-prefill cell on a GPU takes the gathered path; decode,
    short chunks, small GQA rows, fewer query tiles than SMs, explicit splits, oversized buffers
    and the CPU do not;
    FORCE_GATHER overrides the rule both ways."""
    monkeypatch.setattr(op, "sm_count", lambda device: 132)  # the H200's
    cache = torch.empty(1, 16, 8, 128, dtype=BF16, device="meta")  # [pages, page, h_k, d]
    cell = _meta_q(8, 512, 32)
    assert op.gathers(cell, cache, 4608, 0) and op.gathers(cell, cache, 4608, 1)
    assert not op.gathers(cell, cache, 4608, 4)  # an explicit split count
    assert not op.gathers(_meta_q(8, 1, 32), cache, 4608, 0)  # decode
    assert not op.gathers(_meta_q(8, 64, 32), cache, 4608, 0)  # below a dense query tile
    mha = torch.empty(1, 16, 32, 128, dtype=BF16, device="meta")
    assert not op.gathers(_meta_q(8, 256, 32), mha, 4608, 0)  # 256 rows per key
    assert op.gathers(_meta_q(8, 512, 32), mha, 4608, 0)
    # 1 x 512 tokens x 32 heads: 128 query tiles for 132 SMs, so the split kernel keeps it
    assert not op.gathers(_meta_q(1, 512, 32), cache, 4608, 0)
    assert not op.gathers(cell, cache, 131072, 0)  # 4 GiB of packed K/V
    assert not op.gathers(_meta_q(8, 512, 32, cuda=False), cache, 4608, 0)
    monkeypatch.setattr(op, "FORCE_GATHER", True)
    assert op.gathers(_meta_q(2, 3, 4, cuda=False), cache, 40, 4)
    assert not op.gathers(_meta_q(2, 3, 4, cuda=False), cache, 0, 0)  # nothing to gather
    monkeypatch.setattr(op, "FORCE_GATHER", False)
    assert not op.gathers(cell, cache, 4608, 0)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_gathered_dense_family_follows_backend(backend, device, monkeypatch):
    """backend='triton' keeps the gathered path's dense forward on the portable kernel: the
    family is asked for as 'triton', never 'auto' (which may take the sm90 Gluon kernel)."""
    monkeypatch.setattr(op, "FORCE_GATHER", True)
    asked = []
    orig = op._pick
    monkeypatch.setattr(op, "_pick", lambda b, *a, **kw: asked.append(b) or orig(b, *a, **kw))
    c = KVCase(b=2, s_q=5, h=4, h_k=2, page=3, causal=True, capacity=30)
    q, k_cache, v_cache, kw, _ = _build(c, device)
    ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, backend=backend, **kw)
    assert asked == [backend]


def test_gathered_op_check(device, monkeypatch):
    """The op still passes opcheck when it runs the dense op inside (schema, fake, mutation)."""
    monkeypatch.setattr(op, "FORCE_GATHER", True)
    c = KVCase(b=2, s_q=3, h=4, h_k=2, page=3, s_new=2, causal=True, rotary="halves", capacity=20)
    q, k_cache, v_cache, kw, _ = _build(c, device)
    args = (q, k_cache, v_cache, kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"],
            kw["cache_seqlens"], None, None, kw["block_table"], None, 0.125, -1, 0, 0.0, False, 0)
    torch.library.opcheck(op.kvcache_fwd, args)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("sm90", [False, True], ids=["gathered", "sm90-paged"])
def test_long_chunk_paths_in_cuda_graph(sm90, monkeypatch):
    """The long-chunk paths (gathered; sm90 paged on Hopper) sync nowhere (a sync fails the
    capture): captured once, a replay after the cache lengths changed in place matches an eager
    call bitwise."""
    from ioattn.dispatch import sm90_unavailable_reason

    if sm90 and sm90_unavailable_reason(torch.device("cuda")) is not None:
        pytest.skip("the sm90 paged forward needs a Hopper GPU")
    monkeypatch.setattr(op, "FORCE_SM90_PAGED", sm90)
    c = KVCase(b=3, s_q=256, h=32, h_k=8, d=128, page=16, capacity=1024, causal=True)
    q, k_cache, v_cache, kw, opts = _build(c, "cuda")
    assert sm90 or op.gathers(q, k_cache, kw["block_table"].shape[1] * c.page, 0)

    def step():
        return ioattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **opts)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, checks the index values
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    kw["cache_seqlens"].copy_(torch.tensor([1024, 0, 300], dtype=torch.int32))
    graph.replay()
    torch.testing.assert_close(out, step(), atol=0, rtol=0)

"""The head-sparse execution of MoHAttention equals the dense-and-mask one, forward and backward."""
import copy

import pytest
import torch
from attention_oracle import dense_and_mask

from moh_lightning.layers import KVCache, MoHAttention
from moh_lightning.layers.head_sparse_attention import head_sparse_attention, use_head_sparse

# fp32 rounding of other summation orders; one GQA weight-gradient element measured 1.05e-5 off with one thread.
TOL = {"atol": 2e-5, "rtol": 0.0}


def _pair(**kwargs) -> tuple[MoHAttention, MoHAttention]:
    torch.manual_seed(0)
    dense = MoHAttention(64, execution="masked", **kwargs)
    sparse = copy.deepcopy(dense)
    sparse.execution = "sparse"
    return dense, sparse


def _forward_backward(layer: MoHAttention, x: torch.Tensor, **kwargs):
    x = x.clone().requires_grad_()
    out = layer(x, **kwargs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    loss = (out * weight).sum()
    if layer.load_balance_loss is not None:
        loss = loss + layer.load_balance_loss
    loss.backward()
    return out, x.grad, {name: p.grad for name, p in layer.named_parameters()}


CASES = {
    "bidirectional": ({"num_heads": 8, "num_shared_heads": 2, "top_k": 2}, {}),
    "causal": ({"num_heads": 8, "num_shared_heads": 2, "top_k": 3, "causal": True}, {}),
    "no_shared_heads": ({"num_heads": 4, "num_shared_heads": 0, "top_k": 2}, {}),
    "single_stage": ({"num_heads": 8, "num_shared_heads": 1, "top_k": 4, "two_stage_routing": False}, {}),
    "gqa_causal": ({"num_heads": 8, "num_shared_heads": 2, "top_k": 2, "num_kv_heads": 2, "causal": True}, {}),
    "gqa_unaligned": ({"num_heads": 8, "num_shared_heads": 1, "top_k": 3, "num_kv_heads": 4}, {}),
    "qk_norm": ({"num_heads": 8, "num_shared_heads": 2, "top_k": 2, "qk_norm": True,
                 "norm_layer": torch.nn.LayerNorm}, {}),
    "padding_causal": ({"num_heads": 8, "num_shared_heads": 2, "top_k": 2, "causal": True}, {"padding": True}),
    "attn_mask": ({"num_heads": 8, "num_shared_heads": 2, "top_k": 2}, {"attn_mask": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_equals_dense_forward_backward(case):
    kwargs, extra = CASES[case]
    dense, sparse = _pair(**kwargs)
    dense.train(), sparse.train()
    x = torch.randn(3, 150, 64, generator=torch.Generator().manual_seed(2))   # > one causal chunk of slots
    call = {}
    if extra.get("padding"):
        padding_mask = torch.ones(3, 150, dtype=torch.bool)
        padding_mask[0, -20:] = False
        padding_mask[2, -75:] = False
        call["padding_mask"] = padding_mask
    if extra.get("attn_mask"):
        call["attn_mask"] = torch.randn(1, 8, 150, 150, generator=torch.Generator().manual_seed(3))
    out_d, dx_d, grads_d = _forward_backward(dense, x, **call)
    out_s, dx_s, grads_s = _forward_backward(sparse, x, **call)
    torch.testing.assert_close(out_s, out_d, **TOL)
    torch.testing.assert_close(dx_s, dx_d, **TOL)
    assert grads_d.keys() == grads_s.keys()
    for name, grad in grads_d.items():
        assert grad is not None, name
        torch.testing.assert_close(grads_s[name], grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    assert any("router" in name for name in grads_d)


@pytest.mark.parametrize("length, num_keys, num_kv_heads, causal, padded", [
    (70, 70, 8, False, False), (70, 70, 8, True, False), (70, 70, 4, True, True), (150, 150, 2, False, True),
    (1, 40, 8, True, False), (5, 40, 4, True, True), (1, 40, 8, False, False),
])
def test_core_equals_dense_and_mask(length, num_keys, num_kv_heads, causal, padded):
    """Query i at position num_keys - length + i (a KV cache before it); gradients of q, k, v and every gate
    that is on (skipped gates get none: the router's derivative there is zero)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, length, 16, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, num_kv_heads, num_keys, 16, generator=generator, requires_grad=True) for _ in range(2))
    top = torch.randn(2, length, 6, generator=generator).topk(3, dim=-1).indices
    on = torch.cat([torch.ones(2, length, 2), torch.zeros(2, length, 6).scatter(-1, top, 1.0)], dim=-1)
    gates = (on * (torch.rand(2, length, 8, generator=generator) + 0.5)).requires_grad_()
    padding = None
    if padded:
        padding = torch.ones(2, num_keys, dtype=torch.bool)
        padding[0, -3:] = False
    offset = num_keys - length
    out = head_sparse_attention(q, k, v, gates, 2, causal=causal, offset=offset, key_padding_mask=padding)
    ref = dense_and_mask(q, k, v, gates, causal, offset, padding)
    torch.testing.assert_close(out, ref, **TOL)
    weight = torch.randn(ref.shape, generator=generator)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v, gates))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v, gates))
    for grad, ref_grad in zip(grads[:3], ref_grads[:3], strict=True):
        torch.testing.assert_close(grad, ref_grad, **TOL)
    torch.testing.assert_close(grads[3] * on, ref_grads[3] * on, **TOL)


def test_sparse_skips_unselected_pairs():
    """Perturbing a query no gate selects leaves the sparse output unchanged: its attention was never run."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 40, 8).unbind(0)
    gates = torch.ones(2, 40, 4)
    gates[:, 5, 3] = 0.0
    out = head_sparse_attention(q, k, v, gates, num_shared_heads=1)
    q[:, 3, 5] = float("nan")
    again = head_sparse_attention(q, k, v, gates, num_shared_heads=1)
    torch.testing.assert_close(again, out)


@pytest.mark.parametrize("causal", [False, True])
def test_no_routed_head_selected(causal):
    q, k, v = torch.randn(3, 2, 4, 10, 8).unbind(0)
    gates = torch.zeros(2, 10, 4)
    gates[..., 0] = 1.0
    out = head_sparse_attention(q, k, v, gates, num_shared_heads=1, causal=causal)
    assert out[..., 1:, :].abs().max() == 0 and out[..., 0, :].abs().max() > 0


@pytest.mark.parametrize("num_kv_heads", [8, 4])
def test_sparse_kv_cache_decode_equals_dense(num_kv_heads):
    dense, sparse = _pair(num_heads=8, num_shared_heads=2, top_k=2, causal=True, num_kv_heads=num_kv_heads)
    dense.eval(), sparse.eval()
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(4))
    caches = [KVCache(2, num_kv_heads, 64, 8) for _ in range(2)]
    with torch.no_grad():
        for layer, cache in zip((dense, sparse), caches, strict=True):
            layer(x[:, :32], kv_cache=cache)
        for step in range(32, 40):
            outs = [layer(x[:, step:step + 1], kv_cache=cache)
                    for layer, cache in zip((dense, sparse), caches, strict=True)]
            torch.testing.assert_close(outs[1], outs[0], **TOL)
        chunk = [layer(x[:, :5], kv_cache=cache) for layer, cache in zip((dense, sparse), caches, strict=True)]
    torch.testing.assert_close(chunk[1], chunk[0], **TOL)   # several new tokens after a cache: offset positions


def test_query_norm_router_sparse_at_inference_dense_in_training():
    dense, sparse = _pair(num_heads=8, num_shared_heads=2, top_k=3, router="query_norm", causal=True)
    x = torch.randn(2, 96, 64)
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), dense(x), **TOL)
    with pytest.raises(ValueError, match="straight-through"):
        sparse(x)
    sparse.execution = "auto"
    torch.testing.assert_close(sparse(x), dense(x), **TOL)


@pytest.fixture
def threads():
    """Sets torch's intra-op thread count for one test (``auto`` reads it), then restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_auto_chooses_from_shapes(threads):
    threads(1)
    assert not use_head_sparse("auto", 197, 197, 0.5, decoding=False)       # ViT-S: attention is cheap
    assert use_head_sparse("auto", 1024, 1024, 0.5, decoding=False)
    assert not use_head_sparse("auto", 1024, 1024, 7 / 8, decoding=False)   # one skipped head of 8
    assert use_head_sparse("auto", 1, 4096, 7 / 8, decoding=True)
    assert not use_head_sparse("auto", 1, 2048, 7 / 8, decoding=True)
    assert not use_head_sparse("auto", 1, 1024, 0.5, decoding=True)
    threads(2)                                                              # dense decoding uses both cores
    assert use_head_sparse("auto", 1, 4096, 0.5, decoding=True)
    assert not use_head_sparse("auto", 1, 2048, 0.5, decoding=True)
    assert not use_head_sparse("auto", 1, 16384, 0.75, decoding=True)
    assert use_head_sparse("auto", 1024, 1024, 0.5, decoding=False)
    threads(4)
    assert not use_head_sparse("auto", 1, 16384, 0.5, decoding=True)
    assert not use_head_sparse("auto", 4096, 4096, 1.0, decoding=False)
    assert use_head_sparse("sparse", 8, 8, 1.0, decoding=False)
    assert not use_head_sparse("masked", 4096, 4096, 0.5, decoding=False)


@pytest.mark.parametrize("length, num_keys", [(300, 300), (200, 260)])
def test_causal_staircase_blocks_equal_dense_and_mask(monkeypatch, length, num_keys):
    """The CPU causal path over several blocks: the keys before each block's first position in one unmasked call,
    the staircase by chunks, merged by log-sum-exp; forward and the flash kernel's backward per part."""
    from moh_lightning.layers import head_sparse_causal

    monkeypatch.setattr(head_sparse_causal, "CAUSAL_CHUNK", 16)
    monkeypatch.setattr(head_sparse_causal, "CAUSAL_BLOCK", 96)
    plans = []
    plan = head_sparse_causal.causal_plan
    monkeypatch.setattr(head_sparse_causal, "causal_plan", lambda *a: plans.append(plan(*a)) or plans[-1])
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(2, 8, length, 16, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 8, num_keys, 16, generator=generator, requires_grad=True) for _ in range(2))
    top = torch.randn(2, length, 6, generator=generator).topk(2, dim=-1).indices
    on = torch.cat([torch.ones(2, length, 2), torch.zeros(2, length, 6).scatter(-1, top, 1.0)], dim=-1)
    gates = on * (torch.rand(2, length, 8, generator=generator) + 0.5)
    offset = num_keys - length
    out = head_sparse_attention(q, k, v, gates, 2, causal=True, offset=offset)
    assert plans and sum(first > 0 for _, _, first, _ in plans[0]) >= 2   # several blocks with unmasked keys
    ref = dense_and_mask(q, k, v, gates, True, offset, None)
    torch.testing.assert_close(out, ref, **TOL)
    weight = torch.randn(ref.shape, generator=generator)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, **TOL)


@pytest.mark.parametrize("num_kv_heads, padded, active", [(8, False, 4), (4, True, None), (2, False, 6)])
def test_batched_decode_equals_per_pair_decode_and_dense(num_kv_heads, padded, active):
    """The device path of decoding (one batched call over gathered heads, no loop, no host read when the layer
    gives its number of active heads) equals the CPU's per-pair path and the dense-and-mask formulation."""
    from moh_lightning.layers.head_sparse_attention import _decode_pairs, decode_batched

    generator = torch.Generator().manual_seed(7)
    q = torch.randn(3, 8, 1, 16, generator=generator)
    k, v = (torch.randn(3, num_kv_heads, 50, 16, generator=generator) for _ in range(2))
    top = torch.randn(3, 1, 6, generator=generator).topk(2, dim=-1).indices
    on = torch.cat([torch.ones(3, 1, 2), torch.zeros(3, 1, 6).scatter(-1, top, 1.0)], dim=-1)
    gates = on * (torch.rand(3, 1, 8, generator=generator) + 0.5)
    padding = None
    key_bias = None
    if padded:
        padding = torch.ones(3, 50, dtype=torch.bool)
        padding[1, -7:] = False
        key_bias = torch.where(padding[:, None, None], 0.0, float("-inf"))
    group = 8 // num_kv_heads
    batched = decode_batched(q, k, v, gates, group, key_bias, active)
    torch.testing.assert_close(batched, _decode_pairs(q, k, v, gates, group, key_bias), **TOL)
    torch.testing.assert_close(batched, dense_and_mask(q, k, v, gates, True, 49, padding), **TOL)


def test_auto_on_cuda_follows_the_cuda_table(threads, monkeypatch):
    """``auto`` on CUDA runs head-sparse only where ``benchmarks/attention_cuda.py`` measured it faster: with no table,
    never; ``sparse`` always."""
    import moh_lightning.layers.head_sparse_cuda as cuda
    from moh_lightning.layers.execution import runs_head_sparse

    threads(1)
    assert runs_head_sparse("auto", "cpu", 1, 4096, 0.5, decoding=True, causal=True)
    monkeypatch.setattr(cuda, "CUDA_SPARSE", {})
    assert not runs_head_sparse("auto", "cuda", 1, 4096, 0.5, decoding=True, causal=True)
    assert not runs_head_sparse("auto", "cuda", 4096, 4096, 0.5, decoding=False, causal=False)
    assert runs_head_sparse("sparse", "cuda", 1, 4096, 0.5, decoding=True, causal=True)
    monkeypatch.setattr(cuda, "CUDA_SPARSE", {"causal": (2048, 0.75), "decode": (8192, 0.5)})
    assert runs_head_sparse("auto", "cuda", 4096, 4096, 0.5, decoding=False, causal=True)
    assert not runs_head_sparse("auto", "cuda", 1024, 1024, 0.5, decoding=False, causal=True)
    assert not runs_head_sparse("auto", "cuda", 4096, 4096, 0.5, decoding=False, causal=False)
    assert runs_head_sparse("auto", "cuda", 1, 8192, 0.5, decoding=True, causal=True)
    assert not runs_head_sparse("auto", "cuda", 1, 8192, 0.75, decoding=True, causal=True)
    assert not runs_head_sparse("auto", "cuda", 4096, 4096, 1.0, decoding=False, causal=True)

"""The CUDA head-sparse backend equals dense-and-mask: its layouts on the CPU through reference kernels, its kernels
on a GPU.

On the CPU, varlen FlashAttention is replaced by a per-sequence SDPA loop (rows past the last sequence come back
NaN, as unwritten memory may), and FlexAttention by SDPA over the mask its ``BlockMask`` describes (the visited key
blocks, ``mask_mod`` inside the partial ones); FlexAttention's own eager forward also runs on the CPU.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from attention_oracle import dense_and_mask
from torch.nn.attention.flex_attention import create_mask, flex_attention

from moh_lightning.layers import MoHAttention
from moh_lightning.layers.head_sparse_cuda import (
    causal_block_mask,
    causal_slots,
    decode_block_mask,
    head_sparse_attention_cuda,
    pack_selected,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


def varlen_reference(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, **_):
    """``varlen_attn`` by a loop: sequence i's queries q[cu_q[i]:cu_q[i+1]] against its keys k[cu_k[i]:cu_k[i+1]]."""
    starts_q, starts_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    parts = []
    for i in range(len(starts_q) - 1):
        assert starts_q[i + 1] - starts_q[i] <= max_q and starts_k[i + 1] - starts_k[i] <= max_k
        qi, ki, vi = (t[a:b].transpose(0, 1) for t, a, b in ((q, starts_q[i], starts_q[i + 1]),
                                                            (k, starts_k[i], starts_k[i + 1]),
                                                            (v, starts_k[i], starts_k[i + 1])))
        parts.append(F.scaled_dot_product_attention(qi, ki, vi).transpose(0, 1))
    unwritten = q.new_full((q.shape[0] - starts_q[-1], *q.shape[1:]), float("nan"))
    return torch.cat([*parts, unwritten])


def flex_reference(q, k, v, block_mask, enable_gqa=False):
    """FlexAttention by SDPA: a key is seen where its block is a full block, or a partial one whose ``mask_mod``
    allows it; a row that sees no key is zero."""
    batch, heads, length, _ = q.shape
    num_keys = k.shape[2]
    size = block_mask.BLOCK_SIZE[0]

    def visited(num, index):
        in_range = torch.arange(index.shape[-1]) < num[..., None]                # indices past num do not count
        blocks = (F.one_hot(index.long(), -(-num_keys // size)).bool() & in_range[..., None]).any(-2)
        return blocks.repeat_interleave(size, -2)[..., :length, :].repeat_interleave(size, -1)[..., :num_keys]

    partial = visited(block_mask.kv_num_blocks, block_mask.kv_indices)
    allowed = partial & create_mask(block_mask.mask_mod, batch, heads, length, num_keys, device="cpu")
    if block_mask.full_kv_num_blocks is not None:
        allowed |= visited(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=enable_gqa)
    return torch.where(allowed.any(-1, keepdim=True), out, 0.0)


def _inputs(length, num_keys, num_kv_heads, top_k, dtype=torch.float32, seed=0, heads=8, shared=2):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, length, 16, generator=generator).to(dtype).requires_grad_()
    k, v = (torch.randn(2, num_kv_heads, num_keys, 16, generator=generator).to(dtype).requires_grad_()
            for _ in range(2))
    top = torch.randn(2, length, heads - shared, generator=generator).topk(top_k, dim=-1).indices
    on = torch.cat([torch.ones(2, length, shared), torch.zeros(2, length, heads - shared).scatter(-1, top, 1.0)], -1)
    gates = (on * (torch.rand(2, length, heads, generator=generator) + 0.5)).to(dtype).requires_grad_()
    return q, k, v, gates


def _assert_equal_with_gradients(out, ref, inputs, atol):
    """Outputs and the gradients of q, k, v and of every gate that is on (a skipped pair's gate gets none: the
    router's derivative there is zero)."""
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9)).to(ref.dtype)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    gates = inputs[-1]
    for grad, ref_grad in zip(grads, ref_grads):
        assert not grad.isnan().any()
        if grad.shape == gates.shape:
            ref_grad = torch.where(gates != 0, ref_grad, 0.0)
        torch.testing.assert_close(grad.float(), ref_grad.float(), atol=atol, rtol=0)


def test_pack_selected_orders_pairs_by_sequence_and_kv_head():
    """Pairs (b, e, n) packed in that order; one varlen sequence per (b, kv head) holding its query heads' pairs."""
    selected = torch.tensor([[[1, 0, 1], [0, 1, 0], [1, 1, 1], [0, 0, 0]],
                             [[0, 0, 1], [1, 0, 0], [0, 1, 0], [1, 1, 0]]], dtype=torch.bool)   # (B=2, E=4, N=3)
    source, cu_seq_q, filled = pack_selected(selected, kv_group=2, total=14)
    assert cu_seq_q.tolist() == [0, 3, 6, 8, 11] and cu_seq_q.dtype == torch.int32
    assert source[:11].tolist() == selected.reshape(-1).nonzero().squeeze(1).tolist()
    assert filled.tolist() == [True] * 11 + [False] * 3


@pytest.mark.parametrize("num_kv_heads, top_k, budget", [(8, 2, True), (4, 3, True), (2, 2, False), (8, 6, True)])
def test_bidirectional_varlen_layout_equals_dense_and_mask(num_kv_heads, top_k, budget):
    """bf16 forward and backward (q, k, v, gates) through the packed varlen layout, against dense-and-mask in fp32;
    one token's selected gate underflows to zero, so the budget leaves an unwritten row that must not leak."""
    q, k, v, gates = _inputs(40, 40, num_kv_heads, top_k, torch.bfloat16)
    with torch.no_grad():
        gates[0, 3, 2:] = 0.0
    calls = []

    def varlen(*args, **kwargs):
        calls.append(args[3])
        return varlen_reference(*args, **kwargs)

    out = head_sparse_attention_cuda(q, k, v, gates, 2, active_heads=2 + top_k if budget else None, varlen=varlen)
    ref = dense_and_mask(*(t.float() for t in (q, k, v, gates)))
    group = 8 // num_kv_heads
    routed_kv_heads = 6 // group if 2 % group == 0 else 6        # else each routed head gets its kv head copied
    assert len(calls) == 1 and len(calls[0]) == 2 * routed_kv_heads + 1
    _assert_equal_with_gradients(out, ref, (q, k, v, gates), atol=3e-2)


def test_causal_slots_and_block_mask_skip_what_no_query_sees():
    """Slots in position order with -1 padding; per query block, only key blocks up to its largest position are
    visited, those before its smallest need no mask, and padding blocks visit none."""
    selected = torch.zeros(1, 2, 300, dtype=torch.bool)
    selected[0, 0, ::3] = True                                    # 100 queries spread over 300 positions
    selected[0, 1, 280:] = True                                   # 20 queries at the end
    token, q_pos = causal_slots(selected, offset=10)
    assert token[0, 0, :100].tolist() == list(range(0, 300, 3)) and (q_pos[0, 0, 100:] == -1).all()
    assert q_pos[0, 1, :20].tolist() == list(range(290, 310)) and (q_pos[0, 1, 20:] == -1).all()
    # Padding slots gather their own index: no token is gathered more than twice per (sequence, head).
    assert token[0, 1, 20:].tolist() == list(range(20, 300))
    assert max(torch.bincount(token[0, h]).max() for h in range(2)) <= 2
    mask = causal_block_mask(q_pos, 310, block=64)
    visited = mask.kv_num_blocks + mask.full_kv_num_blocks                          # (1, 2, 5)
    assert visited[0, 0].tolist() == [4, 5, 0, 0, 0]        # slots 0-63 reach position 199, 64-99 reach 307
    assert visited[0, 1].tolist() == [5, 0, 0, 0, 0]
    assert mask.full_kv_num_blocks[0, 0, :2].tolist() == [0, 3]   # slots 64-99 start at 202: blocks 0-2 unmasked
    assert mask.full_kv_num_blocks[0, 1, 0] == 4             # positions 290+ see blocks 0-3 unmasked
    padded = causal_block_mask(q_pos, 310, key_valid=torch.ones(1, 310, dtype=torch.bool), block=64)
    assert (padded.full_kv_num_blocks == 0).all() and (padded.kv_num_blocks == visited).all()


@pytest.mark.parametrize("length, num_keys, num_kv_heads, padded", [
    (150, 150, 8, False), (150, 150, 2, True), (100, 160, 4, False), (300, 300, 8, True)])
def test_causal_flex_layout_equals_dense_and_mask(monkeypatch, length, num_keys, num_kv_heads, padded):
    """Forward and backward through the slots, position buffer and block mask (FlexAttention emulated by SDPA over
    the mask the BlockMask describes); queries after a KV cache of num_keys - length positions."""
    import moh_lightning.layers.head_sparse_cuda as cuda

    q, k, v, gates = _inputs(length, num_keys, num_kv_heads, 3)
    padding = None
    if padded:
        padding = torch.ones(2, num_keys, dtype=torch.bool)
        padding[1, -30:] = False
    offset = num_keys - length
    blocks = []
    block_mask = cuda.causal_block_mask
    monkeypatch.setattr(cuda, "causal_block_mask",
                        lambda *a, **kw: blocks.append(block_mask(*a, **kw, block=32)) or blocks[-1])
    out = head_sparse_attention_cuda(q, k, v, gates, 2, causal=True, offset=offset, key_padding_mask=padding,
                                     flex=flex_reference)
    assert blocks and blocks[0].kv_num_blocks.sum() + blocks[0].full_kv_num_blocks.sum() < \
        blocks[0].kv_indices.shape[-1] * blocks[0].kv_num_blocks.numel()           # key blocks were skipped
    ref = dense_and_mask(q, k, v, gates, True, offset, padding)
    _assert_equal_with_gradients(out, ref, (q, k, v, gates), atol=1e-5)


@pytest.mark.parametrize("num_kv_heads, padded", [(8, False), (2, True)])
@pytest.mark.slow
def test_causal_and_decoding_with_flex_attention_forward_on_the_cpu(num_kv_heads, padded):
    """torch's own FlexAttention (eager; its forward runs on the CPU) over the causal slots and the decoding mask."""
    q, k, v, gates = (t.detach() for t in _inputs(150, 150, num_kv_heads, 2))
    padding = None
    if padded:
        padding = torch.ones(2, 150, dtype=torch.bool)
        padding[0, -25:] = False
    out = head_sparse_attention_cuda(q, k, v, gates, 2, causal=True, key_padding_mask=padding, flex=flex_attention)
    torch.testing.assert_close(out, dense_and_mask(q, k, v, gates, True, 0, padding), atol=1e-5, rtol=0)
    last = q[:, :, -1:], gates[:, -1:]
    out = head_sparse_attention_cuda(last[0], k, v, last[1], 2, causal=True, offset=149, key_padding_mask=padding,
                                     flex=flex_attention)
    torch.testing.assert_close(out, dense_and_mask(last[0], k, v, last[1], True, 149, padding), atol=1e-5, rtol=0)


def test_decode_block_mask_reads_only_selected_heads():
    on = torch.tensor([[True, False, True], [False, False, True]])
    mask = decode_block_mask(on, 300, block=128)
    assert mask.kv_num_blocks[..., 0].tolist() == [[3, 0, 3], [0, 0, 3]]


@pytest.mark.parametrize("num_kv_heads", [8, 2])
def test_decoding_through_the_block_mask_equals_dense_and_mask(num_kv_heads):
    q, k, v, gates = _inputs(1, 90, num_kv_heads, 2)
    out = head_sparse_attention_cuda(q, k, v, gates, 2, causal=True, offset=89, flex=flex_reference)
    _assert_equal_with_gradients(out, dense_and_mask(q, k, v, gates, True, 89, None), (q, k, v, gates), atol=1e-5)


# On a GPU: the real kernels through MoHAttention, execution sparse against dense, in bf16.
GPU_CASES = {
    "bidirectional": ({"num_heads": 8, "num_shared_heads": 2, "top_k": 2}, {}),
    "causal": ({"num_heads": 8, "num_shared_heads": 2, "top_k": 3, "causal": True}, {}),
    "gqa_causal": ({"num_heads": 8, "num_shared_heads": 2, "top_k": 2, "num_kv_heads": 2, "causal": True}, {}),
    "gqa_bidirectional": ({"num_heads": 8, "num_shared_heads": 1, "top_k": 3, "num_kv_heads": 4}, {}),
    "padding_causal": ({"num_heads": 8, "num_shared_heads": 2, "top_k": 2, "causal": True}, {"padding": True}),
    "padding_bidirectional": ({"num_heads": 8, "num_shared_heads": 2, "top_k": 2}, {"padding": True}),
}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_cuda_sparse_equals_dense_forward_backward(case, dtype):
    kwargs, extra = GPU_CASES[case]
    torch.manual_seed(0)
    dense = MoHAttention(512, execution="masked", **kwargs).cuda().to(dtype)
    sparse = copy.deepcopy(dense)
    sparse.execution = "sparse"
    x = torch.randn(2, 1000, 512, device="cuda", dtype=dtype)
    call = {}
    if extra.get("padding"):
        call["padding_mask"] = torch.ones(2, 1000, dtype=torch.bool, device="cuda")
        call["padding_mask"][1, -300:] = False
    results = []
    for layer in (dense, sparse):
        xi = x.clone().requires_grad_()
        out = layer(xi, **call)
        out.float().square().mean().backward()
        results.append((out, xi.grad, layer.qkv.weight.grad, layer.router.routed_router.weight.grad))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("num_kv_heads", [8, 2])
def test_cuda_sparse_decoding_equals_dense(num_kv_heads):
    from moh_lightning.layers import KVCache

    torch.manual_seed(0)
    dense = MoHAttention(512, 8, num_shared_heads=2, top_k=2, num_kv_heads=num_kv_heads, causal=True,
                         execution="masked").cuda().to(torch.bfloat16).eval()
    sparse = copy.deepcopy(dense)
    sparse.execution = "sparse"
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    outs = []
    for layer in (dense, sparse):
        cache = KVCache(2, num_kv_heads, 301, 64, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            layer(x, kv_cache=cache)
            outs.append(layer(x[:, -1:], kv_cache=cache))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=2e-2, rtol=2e-2)


@needs_cuda
def test_cuda_sparse_compiles():
    torch.manual_seed(0)
    layer = MoHAttention(512, 8, num_shared_heads=2, top_k=2, causal=True, execution="sparse").cuda()
    x = torch.randn(2, 512, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = layer(x)
        compiled = torch.compile(layer)(x)
    torch.testing.assert_close(compiled.float(), eager.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("path", ["bidirectional", "causal", "decoding"])
def test_cuda_layouts_read_nothing_back_to_the_host(path):
    """Forward and backward of each CUDA layout, with the kernels stubbed by shape-only stand-ins, dispatch no op that
    reads a value back to the host (the GPU would wait) or sizes a tensor by the data: the packing, the slots and the
    block masks are built from counts and positions on the device."""
    from moh_lightning.tools.bench.op_count import DATA_DEPENDENT, count_ops

    length = 1 if path == "decoding" else 150
    q, k, v, gates = _inputs(length, 150, 4, 3, torch.bfloat16 if path == "bidirectional" else torch.float32)

    def step():
        out = head_sparse_attention_cuda(q, k, v, gates, 2, causal=path != "bidirectional", offset=150 - length,
                                         active_heads=5, varlen=lambda q, *_: q * 1.0, flex=lambda q, *_, **__: q * 1.0)
        out.float().sum().backward()

    found = {name for name in count_ops(step) if name in DATA_DEPENDENT}
    assert not found, found

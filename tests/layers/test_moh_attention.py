"""The MoH block: gate structure, equivalence with timm's attention, Eq. 4 by hand, Eq. 7, gradients, masks."""
import pytest
import torch
from timm.layers import Attention

from moh_lightning import MoHAttention, pop_load_balance_loss
from moh_lightning.layers import KVCache, check_head_budget, load_balance_loss, moh_layers

DIM, HEADS = 48, 6


def make(**kwargs) -> MoHAttention:
    torch.manual_seed(0)
    return MoHAttention(DIM, num_heads=HEADS, qkv_bias=True, **kwargs)


@pytest.mark.parametrize("shared, top_k, two_stage", [(2, 2, True), (0, 3, True), (2, 1, False), (1, 4, True)])
def test_gates_have_shared_plus_top_k_nonzero_entries(shared, top_k, two_stage):
    layer = make(num_shared_heads=shared, top_k=top_k, two_stage_routing=two_stage)
    layer(torch.randn(3, 11, DIM))
    gates = layer.last_gates
    assert gates.shape == (3, 11, HEADS)
    assert torch.all((gates != 0).sum(-1) == shared + top_k)
    assert torch.all(gates[..., :shared] > 0)
    assert not gates.requires_grad


@pytest.mark.parametrize("scale_norm", [False, True])
def test_dense_mode_equals_timm_attention_on_same_weights(scale_norm):
    torch.manual_seed(0)
    norms = {"qk_norm": True, "scale_norm": scale_norm, "norm_layer": torch.nn.LayerNorm}
    reference = Attention(DIM, num_heads=HEADS, qkv_bias=True, **norms)
    layer = MoHAttention(DIM, num_heads=HEADS, qkv_bias=True, dense=True, **norms)
    layer.load_state_dict(reference.state_dict())
    with torch.no_grad():  # LayerNorm starts as the identity on its scale; a random affine makes it count
        for name, parameter in layer.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.randn_like(parameter))
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(2, 13, DIM)
    torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=0)
    assert layer.router is None and layer.last_gates is None


def test_timm_weights_load_into_moh_layer_with_fresh_router():
    reference = Attention(DIM, num_heads=HEADS, qkv_bias=True)
    result = make(num_shared_heads=2, top_k=2).load_state_dict(reference.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert all(key.startswith("router.") for key in result.missing_keys) and result.missing_keys


def test_output_is_gate_weighted_sum_of_head_outputs_through_projection():
    layer = make(num_shared_heads=2, top_k=2, attn_head_dim=10).eval()
    x = torch.randn(2, 9, DIM)
    out = layer(x)
    gates = layer.last_gates
    head_dim = 10
    q, k, v = layer.qkv(x).reshape(2, 9, 3, HEADS, head_dim).permute(2, 0, 3, 1, 4)
    attn = (q @ k.transpose(-2, -1) * head_dim ** -0.5).softmax(-1)
    heads = attn @ v                                                   # (B, h, N, d)
    w_o = layer.proj.weight.reshape(DIM, HEADS, head_dim)
    expected = layer.proj.bias.clone()
    for i in range(HEADS):                                             # sum_i g_i H_i W_O^i  (Eq. 4)
        expected = expected + gates[..., i, None] * (heads[:, i] @ w_o[:, i].T)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_uniform_router_with_every_head_active_is_multi_head_attention():
    layer = make(num_shared_heads=2, top_k=4)
    dense = make(dense=True)
    dense.load_state_dict(layer.state_dict(), strict=False)
    for parameter in layer.router.parameters():
        torch.nn.init.zeros_(parameter)
    x = torch.randn(2, 7, DIM)
    torch.testing.assert_close(layer(x), dense(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.last_gates, torch.ones(2, 7, HEADS))


def test_load_balance_loss_hand_computed():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    selected = torch.tensor([[True, False, False], [False, True, False]])
    # f = [1/2, 1/2, 0], P = [0.3, 0.45, 0.25]; sum f P = 0.375; times E = 3
    assert load_balance_loss(probs, selected, None).item() == pytest.approx(1.125)
    # the padded second token does not count: f = [1, 0, 0], P = [0.5, 0.3, 0.2] -> 0.5 * 3
    valid = torch.tensor([True, False])
    assert load_balance_loss(probs, selected, valid).item() == pytest.approx(1.5)
    balanced = torch.full((4, 4), 0.25)
    balanced_selection = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    # The authors' scale: a balanced router's loss is k (here 2 of E = 4), E times the paper's Eq. 7.
    assert load_balance_loss(balanced, balanced_selection, None).item() == pytest.approx(2.0)


def test_load_balance_loss_is_the_authors_formula():
    """SkyworkAI/MoH computes ``torch.mean(me * ce) * E * E`` (me: mean gate, ce: fraction selecting each head)."""
    torch.manual_seed(0)
    probs = torch.randn(64, 6).softmax(-1)
    mask = torch.zeros_like(probs).scatter_(-1, probs.topk(2, dim=-1).indices, 1.0)
    authors = torch.mean(probs.mean(0) * mask.mean(0)) * 6 * 6
    torch.testing.assert_close(load_balance_loss(probs, mask.bool(), None), authors)


def test_layer_load_balance_loss_matches_its_router_and_is_cleared_once_read():
    layer = make(num_shared_heads=2, top_k=2).train()
    x = torch.randn(2, 5, DIM)
    layer(x)
    probs = layer.router.routed_router(x.reshape(-1, DIM)).softmax(-1)
    selected = layer.last_gates.reshape(-1, HEADS)[:, 2:] > 0
    expected = load_balance_loss(probs, selected, None)
    model = torch.nn.Sequential(layer)
    torch.testing.assert_close(pop_load_balance_loss(model), expected)
    assert layer.load_balance_loss is None and pop_load_balance_loss(model) is None
    layer.eval()(x)
    assert layer.load_balance_loss is None


def test_gradients_reach_every_router():
    layer = make(num_shared_heads=2, top_k=2).train()
    out = layer(torch.randn(2, 8, DIM))
    (out.square().mean() + 0.01 * pop_load_balance_loss(layer)).backward()
    names = {name for name, _ in layer.router.named_parameters()}
    assert names == {"shared_router.weight", "routed_router.weight", "type_router.weight"}
    for name, parameter in layer.router.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_padding_is_neither_routed_nor_attended():
    layer = make(num_shared_heads=2, top_k=2).train()
    x = torch.randn(1, 6, DIM)
    padded = torch.cat([x, torch.randn(1, 3, DIM)], dim=1)
    mask = torch.tensor([[True] * 6 + [False] * 3])
    out_padded = layer(padded, padding_mask=mask)
    loss_padded = layer.load_balance_loss
    gates_padded = layer.last_gates
    out = layer(x)
    torch.testing.assert_close(out_padded[:, :6], out, rtol=1e-5, atol=1e-6)
    assert torch.all(gates_padded[:, 6:] == 0)
    torch.testing.assert_close(loss_padded, layer.load_balance_loss)


def test_causal_decoding_with_kv_cache_matches_full_forward():
    layer = make(num_shared_heads=2, top_k=2, causal=True, num_kv_heads=3).eval()
    x = torch.randn(2, 7, DIM)
    full = layer(x)
    cache = KVCache(2, 3, 16, DIM // HEADS)
    steps = [layer(x[:, :4], kv_cache=cache)] + [layer(x[:, i:i + 1], kv_cache=cache) for i in range(4, 7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-6)


def test_query_norm_router_with_every_head_active_is_the_dense_layer():
    layer = make(num_shared_heads=3, top_k=3, router="query_norm")
    dense = make(dense=True)
    dense.load_state_dict(layer.state_dict())
    x = torch.randn(2, 5, DIM)
    torch.testing.assert_close(layer(x), dense(x))
    sparse = make(num_shared_heads=3, top_k=1, router="query_norm")
    sparse(x)
    assert set(sparse.last_gates.unique().tolist()) == {0.0, 1.0}


@pytest.mark.parametrize("shared, top_k, key", [(7, 0, "num_shared_heads"), (2, 5, "top_k"),
                                               (-1, 2, "num_shared_heads"), (6, 2, "top_k"), (2, 0, "top_k")])
def test_impossible_head_budgets_name_the_key(shared, top_k, key):
    with pytest.raises(ValueError, match=key):
        check_head_budget(HEADS, shared, top_k)
    with pytest.raises(ValueError, match=key):
        make(num_shared_heads=shared, top_k=top_k)


def test_moh_layers_skips_dense_layers():
    model = torch.nn.Sequential(make(num_shared_heads=2, top_k=2), make(dense=True))
    assert len(moh_layers(model)) == 1


def _three_linear_router(router, x, valid=None):
    """MoHRouter's formula as it was written before the fused projection: three linears, three softmaxes over the
    heads, the top-k of the scores renormalised, and the load-balance loss from the (T, E) scores."""
    tokens = x.reshape(-1, x.shape[-1])
    shared = routed = loss = None
    if router.num_shared_heads:
        shared = (router.shared_router(tokens).softmax(-1) * router.num_shared_heads
                  if router.shared_router is not None else tokens.new_ones(tokens.shape[0], 1))
    if router.routed_router is not None:
        probs = router.routed_router(tokens).softmax(-1)
        selected = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, probs.topk(router.top_k, -1).indices, True)
        kept = probs * selected
        routed = kept / kept.sum(-1, keepdim=True) * router.top_k
        if router.training and router.top_k < router.num_routed_heads:
            loss = load_balance_loss(probs, selected, valid)
    if router.type_router is not None:
        alpha = router.type_router(tokens).softmax(-1) * 2
        shared, routed = shared * alpha[:, :1], routed * alpha[:, 1:]
    gates = torch.cat([g for g in (shared, routed) if g is not None], dim=-1)
    return gates.reshape(*x.shape[:-1], router.num_heads), loss


@pytest.mark.parametrize("shared, top_k, two_stage, padded", [
    (2, 2, True, False), (2, 2, True, True), (0, 3, True, False), (1, 2, True, False), (1, 2, False, True),
    (3, 3, True, False), (6, 0, True, False), (2, 1, False, False),
])
def test_fused_router_equals_three_linear_formula(shared, top_k, two_stage, padded):
    """One projection over the concatenated router weights and a hand-written backward: the same gates, loss and
    gradients (input and every router weight) as the three linears with autograd, in training and evaluation."""
    layer = make(num_shared_heads=shared, top_k=top_k, two_stage_routing=two_stage)
    router = layer.router
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, 13, DIM, generator=generator)
    valid = torch.rand(3 * 13, generator=generator) > 0.3 if padded else None
    weight = torch.randn(3, 13, HEADS, generator=generator)
    for training in (True, False):
        router.train(training)
        results = []
        for compute in (lambda t: (lambda out: (out.gates, out.load_balance_loss))(router(t, valid=valid)),
                        lambda t: _three_linear_router(router, t, valid)):
            inputs = x.clone().requires_grad_()
            gates, loss = compute(inputs)
            total = (gates * weight).sum() + (0.0 if loss is None else 0.37 * loss)
            params = list(router.parameters())
            grads = torch.autograd.grad(total, [inputs, *params])
            results.append((gates, loss, grads))
        (gates, loss, grads), (ref_gates, ref_loss, ref_grads) = results
        torch.testing.assert_close(gates, ref_gates, rtol=1e-5, atol=1e-6)
        assert (loss is None) == (ref_loss is None) == (not training or top_k in (0, HEADS - shared))
        if loss is not None:
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for grad, ref_grad in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert [name for name, _ in router.named_parameters()] == [
        name for name in ("shared_router.weight", "routed_router.weight", "type_router.weight")
        if getattr(router, name.split(".")[0]) is not None]


def test_fused_router_in_bfloat16_and_without_input_gradient():
    layer = make(num_shared_heads=2, top_k=2).to(torch.bfloat16).train()
    x = torch.randn(2, 9, DIM, dtype=torch.bfloat16)
    out = layer.router(x)
    assert out.gates.dtype == torch.bfloat16 and out.load_balance_loss.dtype == torch.bfloat16
    (out.gates.float().square().sum() + out.load_balance_loss.float()).backward()   # x needs no gradient
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in layer.router.parameters())


def test_moh_config_checks_the_whole_budget_at_construction():
    from moh_lightning.layers.moh_config import MoHConfig

    with pytest.raises(ValueError, match="moh.router='learnt'"):
        MoHConfig(router="learnt")
    with pytest.raises(ValueError, match="moh.router_dtype"):
        MoHConfig(router="query_norm", router_dtype="bf16")
    with pytest.raises(ValueError, match="moh.execution=sparse cannot train the query_norm router"):
        MoHConfig(router="query_norm", execution="sparse")
    with pytest.raises(ValueError, match="moh.execution='fast'"):
        MoHConfig(execution="fast")
    with pytest.raises(ValueError, match="moh.top_k"):
        MoHConfig(top_k=[2, -1])
    with pytest.raises(ValueError, match="moh.top_k=True"):
        MoHConfig(top_k=True)
    with pytest.raises(ValueError, match="moh.num_shared_heads=None"):
        MoHConfig(num_shared_heads=None)
    with pytest.raises(ValueError, match="moh.num_shared_heads has 3 entries but moh.top_k has 2"):
        MoHConfig(num_shared_heads=[1, 2, 2], top_k=[2, 2])
    assert MoHConfig(num_shared_heads=[1, 2], top_k=[2, None]).top_k == [2, None]
    assert MoHConfig(num_shared_heads=2, top_k=[2, 1, 3]).num_shared_heads == 2


def test_the_old_execution_name_dense_means_masked_for_one_release():
    from moh_lightning.layers.moh_config import MoHConfig

    with pytest.warns(FutureWarning, match="now called 'masked'"):
        assert MoHConfig(execution="dense").execution == "masked"
    with pytest.warns(FutureWarning, match="now called 'masked'"):
        assert MoHAttention(32, 4, num_shared_heads=1, top_k=2, execution="dense").execution == "masked"


@pytest.mark.parametrize("router", ["learned", "query_norm"])
@pytest.mark.parametrize("top_k", [2, 4])
def test_load_balance_loss_only_in_training_when_some_routed_head_is_skipped(router, top_k):
    """Each router gives the loss in training with k < E (here E = 4) and nothing to pop otherwise."""
    layer = make(num_shared_heads=2, top_k=top_k, router=router)
    x = torch.randn(2, 5, DIM)
    for training in (True, False):
        layer.train(training)(x)
        loss = pop_load_balance_loss(layer)
        assert (loss is not None) == (training and top_k < 4), (training, loss)
        if loss is not None:
            assert torch.isfinite(loss) and loss > 0


def test_query_norm_router_does_not_count_padding_in_the_load_balance_loss():
    layer = make(num_shared_heads=2, top_k=2, router="query_norm").train()
    x = torch.randn(1, 6, DIM)
    layer(torch.cat([x, torch.randn(1, 3, DIM)], dim=1), padding_mask=torch.tensor([[True] * 6 + [False] * 3]))
    padded = layer.load_balance_loss
    layer(x)
    torch.testing.assert_close(padded, layer.load_balance_loss)


def test_frozen_router_still_passes_its_gradient_to_the_tokens():
    """Freezing the routers (fine-tuning everything else) keeps the routing's share of the input gradient."""
    layer = make(num_shared_heads=2, top_k=2).train()
    router = layer.router
    router.requires_grad_(False)
    x = torch.randn(2, 7, DIM)
    weight = torch.randn(2, 7, HEADS)
    grads = []
    for compute in (lambda t: router(t).gates, lambda t: _three_linear_router(router, t)[0]):
        inputs = x.clone().requires_grad_()
        grads.append(torch.autograd.grad((compute(inputs) * weight).sum(), inputs)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)

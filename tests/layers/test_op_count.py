"""The CPU proxy of a GPU's launch cost: a MoH layer step dispatches few more operations than timm's Attention, and
none of its CUDA paths' passes reads values back to the host."""
from __future__ import annotations

import pytest
import torch

from moh_lightning.layers.router_op import route_rows, route_rows_backward
from moh_lightning.tools.bench.op_count import DATA_DEPENDENT, count_ops, layer_step_ops, op_count_layers


@pytest.mark.slow
def test_masked_layer_step_dispatches_at_most_1_6x_timm_attention():
    layers = op_count_layers()
    base = sum(layer_step_ops(layers["timm Attention"].train()).values())
    for kind in ("bidirectional", "causal"):
        ops = layer_step_ops(layers[f"MoH masked, {kind}"].train())
        assert sum(ops.values()) <= 1.6 * base, (kind, sum(ops.values()), base, ops)
        assert ops["route"] == 1 and ops["route_backward"] == 1  # the router is one op each way


def test_masked_path_and_router_passes_read_nothing_back_to_the_host():
    layer = op_count_layers()["MoH masked, causal"].train()
    ops = layer_step_ops(layer)
    torch.manual_seed(0)
    rows, valid = torch.randn(8, 64), torch.rand(64) > 0.2  # 2 shared, 4 routed, 2 type rows
    layout = (2, 4, 2, 2, 2)
    passes = count_ops(lambda: route_rows_backward(
        torch.randn(64, 6), torch.randn(4), route_rows(rows, valid, *layout, True)[1], valid, *layout))
    found = {name for name in (*ops, *passes) if name in DATA_DEPENDENT}
    assert not found, found

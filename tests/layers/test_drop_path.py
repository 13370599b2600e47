"""``layers.DropPath``: timm's stochastic depth draw for draw when eager, one compiled graph for every rate."""
from __future__ import annotations

import pytest
import timm.layers
import torch
from torch._dynamo.utils import counters

from moh_lightning.layers import DropPath


@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_eager_drop_path_is_timms_draw_for_draw_and_saves_nothing(rate):
    x = torch.randn(16, 5, 4)
    ours, timms = DropPath(rate), timm.layers.DropPath(rate)
    for training in (True, False):
        torch.manual_seed(0)
        expected = timms.train(training)(x)
        torch.manual_seed(0)
        torch.testing.assert_close(ours.train(training)(x), expected, rtol=0, atol=0)
    assert ours.state_dict() == {} and ours.drop_prob == rate


@pytest.mark.slow
def test_compiled_drop_paths_of_every_rate_share_one_graph():
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(64, 3, 2)
    outputs = {}
    for rate in (0.0, 0.3, 1.0):
        layer = DropPath(rate)
        layer.compile(backend="aot_eager")
        outputs[rate] = layer(x)
        torch.testing.assert_close(layer.eval()(x), x)
    assert counters["stats"]["unique_graphs"] == 2  # training and evaluation
    torch.testing.assert_close(outputs[0.0], x)
    assert not outputs[1.0].any()
    kept = outputs[0.3].flatten(1).ne(0).all(1)                           # per sample: all dropped or all kept
    assert 0 < kept.sum() < len(x) and not outputs[0.3][~kept].any()
    torch.testing.assert_close(outputs[0.3][kept], x[kept] / 0.7)

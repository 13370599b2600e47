"""The run summary's head-budget line counts the layers the head-load dashboards draw."""
from __future__ import annotations

from torch import nn

from moh_lightning import MoHAttention
from moh_lightning.callbacks.run_summary import head_budget


def test_a_layer_whose_heads_are_all_shared_is_not_counted_as_routed():
    # dit_folder_90's stages: 4 shared + top-2 / top-3 of 4, then two layers of 8 shared heads (no routed head)
    model = nn.Sequential(MoHAttention(32, 8, num_shared_heads=4, top_k=2),
                          MoHAttention(32, 8, num_shared_heads=4, top_k=3),
                          MoHAttention(32, 8, num_shared_heads=8, top_k=0),
                          MoHAttention(32, 8, num_shared_heads=8, top_k=0))
    line = head_budget(model, [(1, 5)])
    assert line == ("90.6% of heads active per token, 2 routed layers of 4 MoH layers; "
                    "collapsed heads: layer 1 head 5")


def test_every_layer_routed_and_a_dense_model():
    routed = nn.Sequential(*(MoHAttention(32, 8, num_shared_heads=2, top_k=4) for _ in range(2)))
    assert head_budget(routed, []) == "75.0% of heads active per token, 2 routed layers; collapsed heads: none"
    assert head_budget(nn.Sequential(MoHAttention(32, 8, dense=True)), []) == \
        "100.0% of heads active per token (dense: no routed layer)"

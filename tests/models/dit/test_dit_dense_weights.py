"""A MoH-DiT starts from a dense DiT checkpoint in the authors' layout, routers fresh."""
from __future__ import annotations

import pytest
import torch

from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.dit import DiT, DiTConfig, sincos_pos_embed_2d
from moh_lightning.tasks.diffusion import ClassConditionalDiffusion

SHAPE = dict(input_size=8, patch_size=2, in_chans=4, embed_dim=32, depth=2, num_heads=4, num_classes=5)


def test_dense_dit_checkpoint_loads_with_fresh_routers(tmp_path):
    torch.manual_seed(0)
    dense = DiT(DiTConfig(**SHAPE, moh=None))
    state = dict(dense.state_dict())
    state["pos_embed"] = sincos_pos_embed_2d(32, 4).unsqueeze(0)  # the authors keep it as a (frozen) parameter
    torch.save({"model": state, "ema": state, "opt": {}}, tmp_path / "dense.pt")  # their train.py layout

    task = ClassConditionalDiffusion(arch=DiTConfig(**SHAPE, moh=MoHConfig(num_shared_heads=2, top_k=1)),
                                     init_from=str(tmp_path / "dense.pt"))
    own = task.model.state_dict()
    for key, value in dense.state_dict().items():
        assert torch.equal(own[key], value), key
    assert any(".router." in key for key in own)
    assert task.hparams.init_from == str(tmp_path / "dense.pt")
    assert ClassConditionalDiffusion(arch=DiTConfig(**SHAPE)).hparams.init_from is None

    with pytest.raises(ValueError, match="does not fit this model.*not a dense DiT of this config") as error:
        ClassConditionalDiffusion(arch=DiTConfig(**dict(SHAPE, depth=3)), init_from=str(tmp_path / "dense.pt"))
    assert "\n" not in str(error.value)
    with pytest.raises(FileNotFoundError, match="init_from=.*no such weights file"):
        ClassConditionalDiffusion(arch=DiTConfig(**SHAPE), init_from=str(tmp_path / "missing.pt"))
    # The name it had before every task used init_from still loads, with a warning, for one release.
    with pytest.warns(FutureWarning, match="init_from_dense is now model.init_args.init_from"):
        old = ClassConditionalDiffusion(arch=DiTConfig(**SHAPE, moh=MoHConfig(num_shared_heads=2, top_k=1)),
                                        init_from_dense=str(tmp_path / "dense.pt"))
    assert torch.equal(old.model.state_dict()["x_embedder.proj.weight"], dense.state_dict()["x_embedder.proj.weight"])
    with pytest.raises(ValueError, match="init_from_dense and model.init_args.init_from are both set"):
        ClassConditionalDiffusion(arch=DiTConfig(**SHAPE), init_from="a.pt", init_from_dense="b.pt")

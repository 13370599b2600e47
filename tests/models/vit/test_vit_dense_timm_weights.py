"""A MoH-ViT starts from dense timm ViT weights (a local file here; a timm name online), routers fresh."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.vit import ViTConfig, create_vit

SHAPE = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5)


@pytest.fixture
def dense_file(tmp_path):
    torch.manual_seed(0)
    dense = VisionTransformer(**SHAPE, in_chans=3).eval()
    path = tmp_path / "dense.pth"
    torch.save(dense.state_dict(), path)
    return dense, path


def _config(path, **overrides):
    fields = dict(SHAPE, in_chans=3, drop_path_rate=0.0, moh=MoHConfig(num_shared_heads=2, top_k=1),
                  pretrained=str(path))
    fields.update(overrides)
    return ViTConfig(**fields)


def test_dense_weights_load_with_fresh_routers(dense_file, tmp_path):
    dense, path = dense_file
    moh = create_vit(_config(path)).eval()
    own = moh.state_dict()
    for key, value in dense.state_dict().items():
        assert torch.equal(own[key], value), key
    assert any(".router." in key for key in own)
    # the dense MoH block (moh: null) reproduces timm's output from the same weights
    plain = create_vit(_config(path, moh=None)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(plain(x), dense(x), atol=1e-5)
    # a safetensors file, another class count (fresh head) and one channel (timm's adapt_input_conv)
    save_file(dense.state_dict(), tmp_path / "dense.safetensors")
    gray = create_vit(_config(tmp_path / "dense.safetensors", num_classes=3, in_chans=1))
    assert torch.equal(gray.blocks[0].attn.qkv.weight, dense.blocks[0].attn.qkv.weight)
    assert gray.head.out_features == 3


def test_weights_that_do_not_fit_stop_in_one_line(dense_file, tmp_path):
    _, path = dense_file
    with pytest.raises(ValueError, match="does not fit this model") as error:
        create_vit(_config(path, embed_dim=32))
    assert "\n" not in str(error.value)
    with pytest.raises(FileNotFoundError, match="no such file"):
        create_vit(_config(tmp_path / "missing.pth"))


def test_hub_name_offline_says_which_file_to_pass(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="pass a local file instead") as error:
        create_vit(_config("vit_tiny_patch16_224.augreg_in21k_ft_in1k", **dict(SHAPE, embed_dim=192, num_heads=3)))
    assert "\n" not in str(error.value)

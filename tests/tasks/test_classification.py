"""ViT classification end to end: the CLI, the shipped configs, the data modules and the head-load dashboards."""
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import yaml
from conftest import class_of
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moh_lightning.cli import main
from moh_lightning.configs import config_dir, resolve_config
from moh_lightning.data.digits import load_mnist_5k
from moh_lightning.data.images import ImageFolderDataModule, MNISTDataModule
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.vit import ViTConfig, create_vit
from moh_lightning.tasks.classification import ImageClassifier
from moh_lightning.trainer_cli import MoHLightningCLI

SMOKE = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2",
         "--data.init_args.batch_size=32", "--trainer.log_every_n_steps=2"]


@pytest.mark.slow
def test_fit_end_to_end_on_embedded_mnist_logs_per_layer_head_load_and_reloads_to_the_same_accuracy(run_dir):
    main(["fit", "--config", "vit_tiny_mnist_75.yaml", *SMOKE])
    version = run_dir / "runs" / "vit_tiny_mnist_75" / "version_0"
    assert list((version / "checkpoints").glob("*.ckpt"))
    assert (version / "head_load" / "layers.png").is_file() and (version / "head_load" / "summary.md").is_file()
    events = EventAccumulator(str(version), size_guidance={"scalars": 0, "images": 0}).Reload()
    depth = 6
    for layer in range(depth):
        # The 6 routed heads (2 and up) share top-4 slots per token: their exact loads sum to 4.
        loads = [events.Scalars(f"head_load_per_head/layer_{layer:02d}/head_{head:02d}")[-1].value
                 for head in range(2, 8)]
        assert all(0.0 <= load <= 1.0 for load in loads) and sum(loads) == pytest.approx(4.0, abs=1e-4)
    scalars = events.Tags()["scalars"]
    for name in ("busiest_head_vs_balanced", "idlest_head_vs_balanced"):
        assert f"head_load_balance/layer_05/{name}" in scalars
    assert "train/load_balance_loss" in scalars and "val/acc1" in scalars
    assert {"head_load/heatmap_train", "head_load/heatmap_val", "head_load/per_class_layer_05"} <= set(
        events.Tags()["images"])
    # Each routed layer's load over even load, a histogram per window: the band narrowing onto 1 in Distributions.
    assert set(events.Tags()["histograms"]) == {f"head_load_vs_even/layer_{layer:02d}" for layer in range(depth)}

    # The checkpoint reloads to the same validation accuracy, every time.
    checkpoint = version / "checkpoints" / "last.ckpt"
    args = ["--config", resolve_config("vit_tiny_mnist_75.yaml"), "--trainer.limit_val_batches=2",
            "--trainer.logger=false"]
    first = MoHLightningCLI(args=["validate", *args, f"--ckpt_path={checkpoint}"]).trainer.callback_metrics
    second = MoHLightningCLI(args=["validate", *args, f"--ckpt_path={checkpoint}"]).trainer.callback_metrics
    assert first["val/acc1"] == second["val/acc1"]
    assert 0.0 <= first["val/acc1"] <= 1.0


def test_print_config_prints_complete_yaml(capsys, run_dir):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "vit_s_75.yaml", "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert class_of(config["model"]["class_path"]) is ImageClassifier
    assert config["model"]["init_args"]["arch"]["num_heads"] == 6
    assert config["model"]["init_args"]["lr"] == 1e-3 and config["model"]["init_args"]["weight_decay"] == 0.05
    assert "trainer" in config and "data" in config


def test_bare_config_names_resolve_to_shipped_configs_and_unknown_names_fail(run_dir):
    assert Path(resolve_config("vit_s_75.yaml")) == config_dir() / "vit_s_75.yaml"
    assert Path(resolve_config("vit_s_75")) == config_dir() / "vit_s_75.yaml"
    (run_dir / "vit_s_75.yaml").write_text("seed_everything: 1\n")
    assert resolve_config("vit_s_75.yaml") == "vit_s_75.yaml"
    with pytest.raises(SystemExit, match="no_such_config"):
        resolve_config("no_such_config.yaml")


@pytest.mark.parametrize("override, key", [("--model.init_args.arch.moh.top_k=7", "top_k"),
                                           ("--model.init_args.arch.moh.num_shared_heads=9", "num_shared_heads"),
                                           ("--model.init_args.load_balance_beta=-0.1", "load_balance_beta")])
def test_invalid_budgets_fail_at_config_time_naming_the_key(override, key, run_dir):
    with pytest.raises(SystemExit, match=key):  # the CLI's one-line error
        main(["fit", "--config", "vit_tiny_mnist_75.yaml", override, "--trainer.fast_dev_run=1"])


def test_missing_image_folder_names_the_key_and_the_embedded_config(tmp_path):
    data = ImageFolderDataModule(data_dir=str(tmp_path / "imagenet"))
    with pytest.raises(FileNotFoundError, match=r"data_dir.*vit_tiny_mnist_75\.yaml"):
        data.setup("fit")


def test_image_folder_serves_timm_transformed_batches(tmp_path, write_image_folder):
    write_image_folder(tmp_path)
    data = ImageFolderDataModule(str(tmp_path), img_size=32, batch_size=4, num_workers=0)
    data.setup("fit")
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (4, 3, 32, 32) and data.num_classes == 2
    images, labels = next(iter(data.val_dataloader()))
    assert images.shape == (4, 3, 32, 32) and set(labels.tolist()) <= {0, 1}


def test_mnist_split_is_fixed_and_disjoint():
    first, second = load_mnist_5k(seed=0), load_mnist_5k(seed=0)
    assert len(first["train"][1]) == 4500 and len(first["val"][1]) == 500
    np.testing.assert_array_equal(first["val"][0], second["val"][0])
    train_rows = {row.tobytes() for row in first["train"][0]}
    assert not any(row.tobytes() in train_rows for row in first["val"][0][:50])
    data = MNISTDataModule(batch_size=8)
    data.setup("fit")
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (8, 1, 28, 28) and labels.dtype == torch.long


def test_timm_vit_weights_load_into_moh_vit_and_dense_mode_reproduces_timm():
    shape = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=6, num_classes=5, drop_path_rate=0.0)
    reference = timm.models.vision_transformer.VisionTransformer(**shape).eval()
    state = reference.state_dict()
    dense = create_vit(ViTConfig(**shape, moh=None)).eval()
    dense.load_state_dict(state)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(dense(x), reference(x), rtol=0, atol=0)
    moh = create_vit(ViTConfig(**shape, moh=MoHConfig(num_shared_heads=2, top_k=[2, 3]))).eval()
    result = moh.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and all(".router." in key for key in result.missing_keys)
    assert [block.attn.active_heads for block in moh.blocks] == [4, 5]


def test_per_layer_budget_lists_must_match_depth():
    with pytest.raises(ValueError, match="top_k has 3 entries but depth=12"):
        ViTConfig(moh=MoHConfig(num_shared_heads=2, top_k=[2, 2, 2]))  # vit_s_75.yaml's ViT-S with 3 budgets


def test_multi_gpu_overlay_switches_strategy_and_keeps_the_experiment(capsys, run_dir):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "vit_b_75.yaml", "--config", "multi_gpu.yaml", "--data.init_args.data_dir=/d",
              "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["strategy"] == "ddp" and config["trainer"]["devices"] == 8
    assert config["model"]["init_args"]["arch"]["moh"]["top_k"] == 5
    assert config["data"]["class_path"] == "moh_lightning.data.images.ImageFolderDataModule"
    assert config["data"]["init_args"]["batch_size"] == 128 and config["data"]["init_args"]["data_dir"] == "/d"

"""`model.init_args.init_from` in ImageClassifier: the suite's own checkpoints (any head budget) and timm weights."""
from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from conftest import run_checkpoints
from lightning.pytorch import Trainer

from moh_lightning.cli import main
from moh_lightning.data.images import MNISTDataModule
from moh_lightning.models.vit import ViTConfig, create_vit, load_vit_weights
from moh_lightning.tasks import ImageClassifier
from moh_lightning.tasks.checkpoints import write_checkpoint
from moh_lightning.trainer_cli import MoHLightningCLI

TINY = dict(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0,
            global_pool="avg", drop_path_rate=0.0)
BUDGET = {"num_shared_heads": 2, "top_k": 1}
# The same shapes for the tiny MNIST recipe from the command line.
TINY_ARGS = ["--model.init_args.arch.embed_dim=32", "--model.init_args.arch.depth=2",
             "--model.init_args.arch.num_heads=4", "--model.init_args.arch.moh.num_shared_heads=2",
             "--model.init_args.arch.moh.top_k=1"]
VALIDATE = ["--trainer.limit_val_batches=1", "--trainer.logger=false", "--trainer.enable_progress_bar=false"]


def _checkpoint(path, seed: int = 0, **arch):
    """A `moh fit`-layout checkpoint of a tiny ImageClassifier with random weights (``seed``)."""
    torch.manual_seed(seed)
    config = ViTConfig(**{**TINY, "moh": BUDGET, **arch})
    network = create_vit(config)
    state = {f"model.{name}": value for name, value in network.state_dict().items()}
    write_checkpoint(path, ImageClassifier, {"arch": asdict(config), "mixup_alpha": 0.0, "cutmix_alpha": 0.0}, state,
                     {})
    return network


def _equal(a: dict, b: dict, keep) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a if keep(name))


def test_a_suite_checkpoint_loads_into_any_head_budget(tmp_path):
    source = _checkpoint(tmp_path / "theirs.ckpt").state_dict()
    same = create_vit(ViTConfig(**TINY, moh=BUDGET))
    assert load_vit_weights(same, str(tmp_path / "theirs.ckpt")) == f"{len(source)} tensors loaded, routers kept"
    assert _equal(same.state_dict(), source, lambda name: True)

    torch.manual_seed(1)
    other = create_vit(ViTConfig(**TINY, moh={"num_shared_heads": 1, "top_k": 2}))  # another split: other routers
    fresh = {name: value.clone() for name, value in other.state_dict().items()}
    said = load_vit_weights(other, str(tmp_path / "theirs.ckpt"))
    assert said.startswith("routers fresh (another head budget)", said.index(", ") + 2)
    routers = sum(".router." in name for name in source)  # 3 a layer: shared, routed and the balance between them
    assert said.endswith(f"left out: {routers} router tensors")
    assert _equal(other.state_dict(), source, lambda name: ".router." not in name)
    assert _equal(other.state_dict(), fresh, lambda name: ".router." in name)

    dense = create_vit(ViTConfig(**{**TINY, "num_classes": 3}, moh=None))
    said = load_vit_weights(dense, str(tmp_path / "theirs.ckpt"))
    assert said.endswith(f"left out: the head (10 classes there, 3 here), {routers} router tensors (this network is "
                         f"dense)")
    assert _equal(dense.state_dict(), source, lambda name: not name.startswith("head."))


def test_dense_weights_leave_every_router_fresh(tmp_path):
    torch.save(create_vit(ViTConfig(**TINY, moh=None)).state_dict(), tmp_path / "dense.pth")
    said = load_vit_weights(create_vit(ViTConfig(**TINY, moh=BUDGET)), str(tmp_path / "dense.pth"))
    assert said.endswith("routers fresh (the weights have none)")


@pytest.mark.slow
def test_validate_from_init_from_equals_validate_from_the_checkpoint(run_dir, caplog):
    tensors = len(_checkpoint(run_dir / "theirs.ckpt").state_dict())
    args = ["validate", "--config", "vit_tiny_mnist_75.yaml", *TINY_ARGS, *VALIDATE]
    restored = MoHLightningCLI(args=[*args, "--ckpt_path=theirs.ckpt"]).trainer.callback_metrics["val/acc1"]
    started = MoHLightningCLI(args=[*args, "--model.init_args.init_from=theirs.ckpt"]).trainer.callback_metrics
    assert started["val/acc1"] == restored
    said = f"moh: model.init_args.init_from=theirs.ckpt: {tensors} tensors loaded, routers kept."
    assert said in caplog.text


def test_a_run_that_restores_a_checkpoint_ends_with_its_weights(tmp_path):
    _checkpoint(tmp_path / "start.ckpt", seed=0)
    restored = _checkpoint(tmp_path / "resume.ckpt", seed=1).state_dict()
    task = ImageClassifier(ViTConfig(**TINY, moh=BUDGET), init_from=str(tmp_path / "start.ckpt"))
    trainer = Trainer(limit_val_batches=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(task, MNISTDataModule(batch_size=8), ckpt_path=tmp_path / "resume.ckpt", verbose=False)
    assert _equal(task.model.state_dict(), restored, lambda name: True)


def test_arch_pretrained_is_init_from_under_its_old_name(tmp_path):
    _checkpoint(tmp_path / "theirs.ckpt")
    with pytest.warns(FutureWarning, match="arch.pretrained is now model.init_args.init_from"):
        task = ImageClassifier(ViTConfig(**TINY, moh=BUDGET, pretrained=str(tmp_path / "theirs.ckpt")))
    assert task.init_from == str(tmp_path / "theirs.ckpt")
    with pytest.raises(ValueError, match="both set"):
        ImageClassifier(ViTConfig(**TINY, moh=BUDGET, pretrained="a.ckpt"), init_from="b.ckpt")


@pytest.mark.slow
def test_a_new_run_from_a_colleagues_checkpoint_starts_at_its_accuracy(run_dir, caplog):
    fit = ["--config", "vit_tiny_mnist_75.yaml", *TINY_ARGS, "--trainer.enable_progress_bar=false"]
    main(["fit", *fit, "--trainer.max_epochs=1", "--trainer.limit_train_batches=24", "--trainer.limit_val_batches=1"])
    theirs = str(run_checkpoints("vit_tiny_mnist_75") / "last.ckpt")
    args = ["validate", "--config", "vit_tiny_mnist_75.yaml", *TINY_ARGS, *VALIDATE]
    trained = MoHLightningCLI(args=[*args, f"--ckpt_path={theirs}"]).trainer.callback_metrics["val/acc1"]
    started = MoHLightningCLI(args=[*args, f"--model.init_args.init_from={theirs}"]).trainer.callback_metrics
    assert trained > 0.3 and started["val/acc1"] == trained  # trained well past chance (0.1), and the same
    other_budget = ["--model.init_args.arch.moh.num_shared_heads=1", "--model.init_args.arch.moh.top_k=2"]
    MoHLightningCLI(args=[*args, *other_budget, f"--model.init_args.init_from={theirs}"])
    assert "routers fresh (another head budget)" in caplog.text


@pytest.mark.slow
def test_a_run_restoring_its_checkpoint_does_not_read_init_from(run_dir, caplog):
    """init_from is where a fresh run starts; a run that restores a checkpoint needs it no more (it may be gone)."""
    _checkpoint(run_dir / "start.ckpt", seed=0)
    restored = _checkpoint(run_dir / "resume.ckpt", seed=1).state_dict()
    args = ["validate", "--config", "vit_tiny_mnist_75.yaml", *TINY_ARGS, *VALIDATE,
            "--model.init_args.init_from=start.ckpt"]
    (run_dir / "start.ckpt").unlink()
    cli = MoHLightningCLI(args=[*args, "--ckpt_path=resume.ckpt"])
    assert _equal(cli.model.model.state_dict(), restored, lambda name: True)
    assert "init_from=start.ckpt" not in caplog.text


@pytest.mark.slow
def test_an_export_timm_folder_loads_and_a_wrong_path_is_one_line(run_dir):
    """The folder `moh export-timm` writes is an init_from source as its model.safetensors is; a mistyped file or a
    folder without weights stops `moh` in one line (no traceback) that says what to give."""
    from moh_lightning.tools.export_timm import export_timm

    torch.manual_seed(0)
    config = ViTConfig(**TINY, moh=BUDGET)
    source = create_vit(config).state_dict()
    write_checkpoint(run_dir / "theirs.ckpt", ImageClassifier, {"arch": asdict(config)},
                     {f"model.{name}": value for name, value in source.items()}, {"crop_scale": [0.7, 1.0]})
    export_timm(str(run_dir / "theirs.ckpt"), str(run_dir / "exported"))
    ours = create_vit(ViTConfig(**TINY, moh=BUDGET))
    assert load_vit_weights(ours, "exported") == f"{len(source)} tensors loaded, routers kept"
    assert _equal(ours.state_dict(), source, lambda name: True)

    (run_dir / "empty").mkdir()
    args = ["validate", "--config", "vit_tiny_mnist_75.yaml", *TINY_ARGS, *VALIDATE]
    for wrong, says in (("exported/model.safetensor", "no such file"), ("empty", "no model.safetensors")):
        with pytest.raises(SystemExit) as stop:
            main([*args, f"--model.init_args.init_from={wrong}"])
        message = str(stop.value)
        assert "\n" not in message and message.startswith(f"moh: model.init_args.init_from={wrong!r}: {says}")

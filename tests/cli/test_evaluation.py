"""Evaluation says what it measured: `moh test` scores a test split (never validation under test keys), evaluation logs
beside the run it scores, and a wrong step stops in one line."""
from __future__ import annotations

import csv
import shutil

import pytest
import torch

from moh_lightning.cli import main

CONFIG = "vit_tiny_folder_digits_75.yaml"
# One block: each evaluation draws a head-load card per routed layer, and what is scored does not depend on depth.
ONE_BLOCK = ["--model.init_args.arch.depth", "1"]


def _fit(folder) -> str:
    main(["fit", "--config", CONFIG, "--data.init_args.data_dir", str(folder), "--trainer.max_steps", "1",
          "--trainer.limit_val_batches", "1", "--data.init_args.batch_size", "4", "--trainer.enable_progress_bar",
          "false", *ONE_BLOCK])
    return "runs/vit_tiny_folder_digits_75/version_0/checkpoints/last.ckpt"


def _always_cat(checkpoint: str) -> None:
    """Makes the checkpoint's classifier answer class 0 (cat) for every image."""
    raw = torch.load(checkpoint, map_location="cpu", weights_only=False)
    raw["state_dict"]["model.head.bias"] = torch.tensor([100.0, -100.0])
    torch.save(raw, checkpoint)


def _metrics(run, name: str) -> dict[str, float]:
    rows = list(csv.DictReader((run / "eval" / name / "metrics.csv").open()))
    return {key: float(value) for row in rows for key, value in row.items() if value and key != "epoch"}


def _evaluate(subcommand: str, folder, checkpoint: str) -> None:
    main([subcommand, "--config", CONFIG, "--data.init_args.data_dir", str(folder), "--ckpt_path", checkpoint,
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.enable_progress_bar", "false",
          *ONE_BLOCK])


@pytest.mark.slow
def test_test_scores_the_test_folder_beside_the_run(run_dir, write_image_folder):
    write_image_folder(run_dir / "data", per_class=2, size=(32, 32))
    checkpoint = _fit(run_dir / "data")
    run = run_dir / "runs/vit_tiny_folder_digits_75/version_0"
    # A mistyped data folder, or one without test/: one line each (the missing folder named as such, the validation
    # split offered), and no eval/test-last folder left behind with only an events file or a metrics file in it, for
    # either logger. Both stop at one point, where the data module sets up the split (ImageFolderDataModule's
    # _split_dir): the CSV logger is checked on one of them.
    message = _one_line(["test", "--ckpt_path", checkpoint, "--data.init_args.data_dir", "dta/"])
    assert "data.init_args.data_dir='dta/': no such folder" in message
    for chosen in ([], ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger"]):
        message = _one_line(["test", "--ckpt_path", checkpoint, *chosen])
        assert "no 'test/' folder" in message and "moh validate" in message
        assert not (run / "eval").exists()

    shutil.copytree(run_dir / "data/train/cat", run_dir / "data/test/cat")  # a test split of cats only
    _always_cat(checkpoint)
    _evaluate("test", run_dir / "data", checkpoint)
    _evaluate("validate", run_dir / "data", checkpoint)
    assert _metrics(run, "test-last")["test/acc1"] == 1.0  # scored the cats of test/: val/ would give 0.5
    assert _metrics(run, "validate-last")["val/acc1"] == 0.5
    assert [p.name for p in run.parent.iterdir()] == ["version_0"]  # no new version of the training run
    assert (run / "eval" / "validate-last" / "head_load" / "loads.json").is_file()  # the head load of that evaluation
    _evaluate("test", run_dir / "data", checkpoint)
    assert (run / "eval" / "test-last-2" / "metrics.csv").is_file()  # a repeat never writes over the first


def _one_line(args: list[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        main(args)
    message = str(stop.value)
    assert "\n" not in message and message.startswith("moh")
    return message


def test_missing_validation_folder_is_one_line(run_dir, write_image_folder):
    write_image_folder(run_dir / "data", per_class=1, size=(32, 32))
    shutil.rmtree(run_dir / "data/val")
    message = _one_line(["fit", "--config", CONFIG, "--data.init_args.data_dir", str(run_dir / "data"),
                         "--trainer.fast_dev_run", "1"])
    assert "no 'val/' folder" in message and "data.init_args.data_dir" in message


def test_gpu_overlay_without_a_gpu_names_the_cpu_override(run_dir):
    message = _one_line(["fit", "--config", "vit_tiny_mnist_75.yaml", "--config", "multi_gpu.yaml"])
    assert "no CUDA GPU" in message and "--trainer.accelerator cpu --trainer.devices 2" in message


def test_embedded_digits_have_no_test_split(run_dir):
    message = _one_line(["test", "--config", "vit_tiny_mnist_75.yaml", "--trainer.logger", "false"])
    assert "no test split" in message and "moh validate" in message


def test_tasks_without_a_test_split_say_so(run_dir):
    message = _one_line(["test", "--config", "dit_mnist_75.yaml", "--trainer.logger", "false"])
    assert "ClassConditionalDiffusion has no test split" in message and "moh validate" in message


@pytest.mark.slow
def test_a_sweep_trials_checkpoint_evaluates_with_no_config_and_with_the_shipped_one(run_dir, write_image_folder,
                                                                                      capsys):
    """A sweep trial's checkpoint (16 pixels, patch 4, 2 blocks, top-2; its config.yaml written by the trial's `moh
    fit`). Evaluated with the shipped config (32 pixels, patch 8, 6 blocks, top-4): the data's 32 pixels stop in one
    line before anything is written; at 16 pixels the network is the checkpoint's, said in one line. Evaluated with
    `--ckpt_path` alone: the run's own config.yaml gives its data and trainer; the test logs its head load and says
    where. A top_k typed on the command line evaluates at it, said in one line; a checkpoint outside a run folder
    stops in one line."""
    write_image_folder(run_dir / "data", per_class=2, size=(32, 32))
    shutil.copytree(run_dir / "data/val", run_dir / "data/test")
    main(["fit", "--config", CONFIG, "--data.init_args.data_dir", str(run_dir / "data"), "--trainer.max_steps", "1",
          "--trainer.limit_val_batches", "1", "--data.init_args.batch_size", "4", "--trainer.enable_progress_bar",
          "false", "--data.init_args.img_size", "16", "--model.init_args.arch.patch_size", "4",
          "--model.init_args.arch.depth", "2", "--model.init_args.arch.moh.top_k", "2",
          "--trainer.logger.init_args.save_dir", "sweeps/heads/runs", "--trainer.logger.init_args.name",
          "moh=k2-seed=0"])
    run = run_dir / "sweeps/heads/runs/moh=k2-seed=0/version_0"
    checkpoint = str(run.relative_to(run_dir) / "checkpoints/last.ckpt")
    shipped = ["--config", CONFIG, "--data.init_args.data_dir", str(run_dir / "data"), "--ckpt_path", checkpoint,
               "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.enable_progress_bar", "false"]
    message = _one_line(["test", *shipped])
    assert ("holds weights of another shape (data.init_args.img_size -> model.init_args.arch.img_size: the "
            "checkpoint's 16, yours 32)") in message
    assert f"--config {run.relative_to(run_dir) / 'config.yaml'}" in message  # the run's, as the checkpoint was named
    assert not (run / "eval").exists()

    capsys.readouterr()
    main(["test", "--ckpt_path", checkpoint, "--trainer.enable_progress_bar", "false"])
    said = capsys.readouterr()
    assert "moh: evaluating" not in said.err and "not the config's" not in said.err
    assert "moh test: metrics and head load in sweeps/heads/runs/moh=k2-seed=0/version_0/eval/test-last" in said.out
    assert (run / "eval" / "test-last" / "head_load" / "loads.json").is_file()

    main(["validate", *shipped, "--data.init_args.img_size", "16"])
    assert ("moh: the checkpoint's network, not the config's: depth 2 (config: 6), top_k 2 (config: 4), patch_size 4 "
            "(config: 8); a --model.init_args.arch.* option overrides a key") in capsys.readouterr().err.splitlines()
    assert _metrics(run, "validate-last")["val/activated_heads"] == 0.5  # 2 shared + top-2 of 6 routed heads
    main(["validate", *shipped, "--data.init_args.img_size", "16", "--model.init_args.arch.moh.top_k", "4"])
    assert ("moh: evaluating at top_k 4; trained at 2 (model.init_args.arch.moh.top_k); the checkpoint's network, "
            "not the config's: depth 2 (config: 6), patch_size 4 (config: 8)") in capsys.readouterr().err
    assert _metrics(run, "validate-last-2")["val/activated_heads"] == 0.75  # 2 shared + top-4 of 6 routed heads

    shutil.copy(checkpoint, "alone.ckpt")
    message = _one_line(["test", "--ckpt_path", "alone.ckpt"])
    assert "not in a run folder with a config.yaml" in message and "--config <yaml>" in message
    assert not (run_dir / "runs").exists()

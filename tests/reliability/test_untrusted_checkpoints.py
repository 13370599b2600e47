"""Checkpoints from someone else run no code: every entry point that opens one refuses a pickle that would.

The malicious file is the one from the issue: a checkpoint in the layout ``moh fit`` writes whose hyper-parameters
hold an object that runs a shell command when unpickled. Each entry point must stop in one line naming the file and
the refused type, and the command must not have run.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from tiny_models import tiny_llama_config

from moh_lightning.cli import main
from moh_lightning.models.dit import DiT, DiTConfig
from moh_lightning.models.llama import MoHLlama
from moh_lightning.serialization import UnsafeCheckpointError, load_file
from moh_lightning.tasks.language_model import LanguageModel
from moh_lightning.tools.lm_eval import remote_code_trusted


class _RunsShell:
    """Unpickles as ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _malicious(path: Path, marker: Path, state_dict: dict | None = None) -> Path:
    """A checkpoint in ``moh fit``'s layout whose pickle touches ``marker`` when it is loaded."""
    torch.save({"state_dict": state_dict or {}, "hyper_parameters": {"lr": 1e-3, "note": _RunsShell(f"touch {marker}")},
                "pytorch-lightning_version": "2.6.0", "epoch": 0, "global_step": 1}, path)
    return path


@pytest.fixture
def evil(run_dir):
    """(malicious checkpoint, the marker file it would create): with a tiny LM's weights, as a real one would be."""
    marker = run_dir / "PWNED"
    weights = {f"model.{k}": v for k, v in MoHLlama(tiny_llama_config()).state_dict().items()}
    return _malicious(run_dir / "shared.ckpt", marker, weights), marker


def _assert_refused(stop: pytest.ExceptionInfo, path: Path, marker: Path) -> None:
    message = str(stop.value)
    assert "\n" not in message and str(path) in message and "posix.system" in message, message
    assert not marker.exists(), "the checkpoint's code ran"


def _corpus(folder: Path) -> Path:
    folder.mkdir()
    for i in range(4):
        folder.joinpath(f"f{i}.py").write_text("\n".join(f"def f{j}(x):\n    return x + {j}" for j in range(300)))
    return folder


LM_FIT = ["fit", "--config", "llm_stdlib_75.yaml", "--model.init_args.max_tokens", "512",
          "--data.init_args.batch_size", "2", "--data.init_args.seq_len", "32",
          "--model.init_args.arch.block_size", "32", "--trainer.limit_val_batches", "1"]


def test_the_loader_refuses_the_file_and_runs_nothing(evil):
    path, marker = evil
    with pytest.raises(UnsafeCheckpointError) as stop:
        load_file(path)
    _assert_refused(stop, path, marker)


@pytest.mark.parametrize("tool", [
    ["generate", "--checkpoint", "{ckpt}", "--prompt", "def"],
    ["export-hf", "--checkpoint", "{ckpt}", "--out", "exported"],
    ["sample", "--checkpoint", "{ckpt}", "--num_samples", "1"],
    ["export-timm", "--checkpoint", "{ckpt}", "--out", "exported"],
    ["digit_quality", "--samples", "{samples}", "--classifier", "{ckpt}"],
    ["lm-eval", "--checkpoint", "{ckpt}", "--include_path", "lm_eval_tasks", "--include_defaults", "false",
     "--tasks", "[python_basics]"],
], ids=lambda args: args[0])
def test_every_tool_refuses_it_in_one_line(evil, tool):
    path, marker = evil
    samples = path.with_name("samples.npz")
    np.savez(samples, arr_0=np.zeros((2, 28, 28, 3), np.uint8), arr_1=np.array([0, 1]))
    with pytest.raises(SystemExit) as stop:
        main([arg.format(ckpt=path, samples=samples) for arg in tool])
    _assert_refused(stop, path, marker)


def test_fit_resuming_last_refuses_it_and_keeps_it(evil, run_dir):
    path, marker = evil
    corpus = _corpus(run_dir / "corpus")
    sources = ["--data.init_args.sources", f"[{{path: {corpus}, pattern: '*.py', val_fraction: 0.3}}]"]
    planted = run_dir / "runs" / "llm_stdlib_75" / "version_0" / "checkpoints" / "last.ckpt"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(path.read_bytes())
    with pytest.raises(SystemExit) as stop:
        main([*LM_FIT, *sources, "--ckpt_path", "last"])
    _assert_refused(stop, planted.relative_to(run_dir), marker)
    assert planted.is_file(), "a refused checkpoint is not damaged: it stays where it was"


def test_fit_from_an_explicit_checkpoint_refuses_it(evil, run_dir):
    path, marker = evil
    corpus = _corpus(run_dir / "corpus")
    sources = ["--data.init_args.sources", f"[{{path: {corpus}, pattern: '*.py', val_fraction: 0.3}}]"]
    with pytest.raises(SystemExit) as stop:
        main([*LM_FIT, *sources, "--ckpt_path", str(path), "--trainer.logger", "false"])
    _assert_refused(stop, path, marker)


@pytest.mark.parametrize("loader", ["vit_pretrained", "dense_dit", "authors_dit", "authors_llama", "transnext"])
@pytest.mark.slow
def test_weight_loaders_refuse_it(run_dir, loader):
    marker = run_dir / "PWNED"
    path = _malicious(run_dir / "weights.pth", marker)
    with pytest.raises(UnsafeCheckpointError) as stop:
        if loader == "vit_pretrained":
            from moh_lightning.models.vit import ViTConfig, create_vit
            create_vit(ViTConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4, moh=None,
                                 pretrained=str(path)))
        elif loader == "dense_dit":
            from moh_lightning.models.dit import load_dense_dit_weights
            load_dense_dit_weights(DiT(DiTConfig(input_size=8, patch_size=4, in_chans=1, num_classes=2,
                                                 embed_dim=32, depth=1, num_heads=2)), str(path))
        elif loader == "authors_dit":
            from moh_lightning.models.dit import read_state_dict
            read_state_dict(str(path))
        elif loader == "authors_llama":
            from moh_lightning.models.llama import read_weights
            path = path.rename(run_dir / "pytorch_model.bin")
            read_weights(run_dir)
        else:
            from moh_lightning.models.transnext import TransNeXtConfig, create_transnext, load_pretrained
            load_pretrained(create_transnext(TransNeXtConfig()), path)
    _assert_refused(stop, path, marker)


def test_a_file_that_is_not_a_suite_checkpoint_is_named_in_one_line(run_dir):
    plain = run_dir / "plain.ckpt"
    torch.save({"weight": torch.zeros(2)}, plain)
    for tool in (["generate", "--checkpoint", str(plain)], ["export-hf", "--checkpoint", str(plain), "--out", "o"],
                 ["sample", "--checkpoint", str(plain)]):
        with pytest.raises(SystemExit) as stop:
            main(tool)
        message = str(stop.value)
        assert "\n" not in message and str(plain) in message and "not a checkpoint of this suite" in message
    text = run_dir / "notes.ckpt"
    text.write_text("not a checkpoint")
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--checkpoint", str(text)])
    assert "\n" not in str(stop.value) and "does not load as a checkpoint" in str(stop.value)


def test_the_suites_own_checkpoints_load_without_running_code(tmp_path):
    """A run started from Python pickles its config dataclasses; those are allowed, and nothing else is needed."""
    task = LanguageModel(tiny_llama_config("tiny_75"))
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.strategy.connect(task)
    task.configure_model()
    trainer.save_checkpoint(tmp_path / "own.ckpt")
    raw = load_file(tmp_path / "own.ckpt")
    assert raw["hyper_parameters"]["arch"] == tiny_llama_config("tiny_75")


def test_lm_eval_trusts_only_the_suites_modelling_file(tmp_path):
    from moh_lightning.models.llama import hf_moh_llama

    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "hf_moh_llama.py").write_bytes(Path(hf_moh_llama.__file__).read_bytes())
    assert remote_code_trusted(ours)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not remote_code_trusted(plain)  # no code: nothing to trust
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "hf_moh_llama.py").write_text("import os\nos.system('touch PWNED')\n")
    with pytest.raises(SystemExit) as stop:
        remote_code_trusted(theirs)
    assert "\n" not in str(stop.value) and "hf_moh_llama.py" in str(stop.value) and "--trust_remote_code" in str(
        stop.value)
    assert remote_code_trusted(theirs, trust_remote_code=True)

"""A run folder that travels: what it keeps and records (a local tokenizer, a continue-tuned model's own config and
vocabulary), what reads it from elsewhere, and what a resume from it says."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import run_checkpoints
from hf_families import TEXT, train_tokenizer
from jsonargparse import Namespace
from tiny_models import tiny_llama_config

from moh_lightning.cli import main as moh
from moh_lightning.data.text import TextDataModule
from moh_lightning.data.tokenizers import load_tokenizer, tokenizer_identity
from moh_lightning.runs import check_resumable, read_kept_tokenizer, resolve_init_from, resolve_source_paths
from moh_lightning.settings import compare_with_checkpoint
from moh_lightning.tasks.checkpoints import load_language_model, write_checkpoint
from moh_lightning.tasks.language_model import SCHEDULE_STEPS, LanguageModel
from moh_lightning.tools.generate import generate

GRANITE = {"model_type": "granite", "vocab_size": 320, "hidden_size": 64, "embedding_multiplier": 3.0}


def test_a_checkpoint_that_recorded_the_tokenizers_size_as_its_vocabulary_still_evaluates():
    """Checkpoints of a continue-tuned model once held the tokenizer's size (300) in arch.vocab_size, and now the
    embedding's rows (320, its hf_config's): evaluating the one under the other is no other shape."""
    older = {"arch": {"vocab_size": 300, "depth": 2}, "hf_config": GRANITE}
    built = {"arch": {"vocab_size": 320, "depth": 2}, "hf_config": GRANITE}
    assert compare_with_checkpoint("validate", "last.ckpt", older, built, {}) is None


def test_a_run_whose_config_yaml_left_hf_config_empty_still_resumes(tmp_path):
    """A config.yaml written before it recorded the source's config (`hf_config: null`) resumes a run that now fills
    it in from init_from: nothing that makes the run differs."""
    saved = {"model": {"init_args": {"init_from": "source", "hf_config": None, "max_tokens": 10}}, "data": {}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    current = {"model": {"init_args": {"init_from": "source", "hf_config": GRANITE, "max_tokens": 20}}, "data": {}}
    assert check_resumable(tmp_path, current) == "model.init_args.max_tokens 10 -> 20"


def test_a_resume_with_a_larger_budget_says_how_the_schedule_changes():
    """The issue's run: 40 steps' budget resumed at step 39 with 50 steps' (3e-6 at step 39 jumped to 9.6e-5 and
    nothing said so). The clause names both lengths and the learning rate at the resume step before and after."""
    task = LanguageModel(tiny_llama_config(), lr=3e-4, min_lr=3e-6, warmup_steps=2, max_tokens=50 * 4 * 16)
    data = SimpleNamespace(hparams=SimpleNamespace(batch_size=4, seq_len=16))
    trainer = SimpleNamespace(accumulate_grad_batches=1, world_size=1)
    before = task.schedule(40)(39)
    checkpoint = {"lr_schedulers": [{"last_epoch": 39, "_last_lr": [before, before]}], SCHEDULE_STEPS: 40}
    said = task.schedule_change(checkpoint, data, trainer)
    assert said == (f"the learning-rate schedule now spans 50 steps, not 40: lr at step 39 {before:.2g} -> "
                    f"{task.schedule(50)(39):.2g}")
    assert task.schedule(50)(39) > 10 * before
    assert task.schedule_change({**checkpoint, SCHEDULE_STEPS: 50}, data, trainer) is None  # the same budget
    # A checkpoint that did not record its length: the learning rate alone tells whether the schedule moved.
    older = {"lr_schedulers": checkpoint["lr_schedulers"]}
    assert task.schedule_change(older, data, trainer).startswith("the learning-rate schedule now spans 50 steps: ")
    data.hparams.batch_size = 5  # a batch whose budget spans 40 steps again
    assert task.schedule_change(older, data, trainer) is None


def test_a_tokenizer_read_from_a_local_folder_is_kept_in_the_run_folder(run_dir):
    """`--data.init_args.tokenizer moh75`, a folder named relative to the working folder: the run keeps a copy in
    `<run>/tokenizer` and records it by its absolute path (once `moh75` as written, which every tool then asked the
    hub for); `byte` and a copy already there are left as they are."""
    train_tokenizer(run_dir / "moh75")
    data = TextDataModule(tokenizer="moh75")
    run = Path("runs/x/version_0")
    assert data.keep_in_run_folder(run) == {"tokenizer": str(run_dir / run / "tokenizer")}
    assert data.hparams.tokenizer == str(run_dir / run / "tokenizer") and Path(data.hparams.tokenizer).is_absolute()
    copy = load_tokenizer(data.hparams.tokenizer)
    assert tokenizer_identity("", copy) == tokenizer_identity("", load_tokenizer("moh75"))
    written = {p: p.stat().st_mtime_ns for p in (run / "tokenizer").iterdir()}
    assert data.keep_in_run_folder(run) == {} and {p: p.stat().st_mtime_ns for p in written} == written
    assert TextDataModule().keep_in_run_folder(run) == {}  # byte: nothing to keep


def test_a_resume_naming_the_tokenizer_it_copied_reads_the_copy(tmp_path, monkeypatch):
    """`--ckpt_path last` with `--data.init_args.tokenizer moh75` typed again reads the run's copy (the same ids), so
    the saved settings match; another tokenizer stays as named, for the settings' check to refuse."""
    monkeypatch.chdir(tmp_path)
    train_tokenizer(tmp_path / "moh75")
    version = tmp_path / "runs" / "x" / "version_0"
    load_tokenizer("moh75").save_pretrained(version / "tokenizer")
    args = Namespace(tokenizer="moh75")
    read_kept_tokenizer(version, args)
    assert args.tokenizer == str(version / "tokenizer")
    other = Namespace(tokenizer="byte")
    read_kept_tokenizer(version, other)
    assert other.tokenizer == "byte"


def test_a_checkpoint_reads_the_kept_tokenizer_beside_it_after_its_run_folder_moved(tmp_path):
    train_tokenizer(tmp_path / "moved" / "version_0" / "tokenizer")
    task = LanguageModel(tiny_llama_config())
    task.configure_model()
    checkpoint = write_checkpoint(tmp_path / "moved" / "version_0" / "checkpoints" / "last.ckpt", LanguageModel,
                                  dict(task.hparams), task.state_dict(),
                                  {"tokenizer": str(tmp_path / "gone" / "version_0" / "tokenizer")})
    _, data_hparams = load_language_model(checkpoint)
    assert data_hparams["tokenizer"] == str(tmp_path / "moved" / "version_0" / "tokenizer")


def test_offline_a_name_that_is_no_folder_here_fails_at_once_in_one_line(run_dir, monkeypatch):
    """A hub that does not answer: offline mode is turned on and the name fails at once (it once retried the hub
    five times, 35 s to 78 s), saying it is no folder of the working folder and in no cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    started = time.monotonic()
    with pytest.raises(OSError) as error:
        load_tokenizer("moh75", key="--tokenizer")
    assert time.monotonic() - started < 20 and constants.HF_HUB_OFFLINE
    assert str(error.value).startswith(f"--tokenizer='moh75': cannot load it: no folder moh75 in {run_dir}, and "
                                       f"offline no hub id moh75 in the Hugging Face cache; ")


def test_local_source_paths_are_recorded_resolved_and_compare_so_on_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "rows.jsonl").write_text("{}")
    args = Namespace(sources=[Namespace(path="corpus", data_files=None), Namespace(path="python-stdlib"),
                              Namespace(path=None, data_files=["rows.jsonl", "missing.jsonl"])])
    resolve_source_paths(args)
    assert [s.get("path") for s in args.sources] == [str(tmp_path / "corpus"), "python-stdlib", None]
    assert args.sources[2].data_files == [str(tmp_path / "rows.jsonl"), "missing.jsonl"]
    # A config.yaml that kept the path as typed resumes the same files named by their absolute path.
    saved = {"model": {}, "data": {"init_args": {"sources": [{"path": "corpus"}]}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    current = {"model": {}, "data": {"init_args": {"sources": [{"path": str(tmp_path / "corpus")}]}}}
    assert check_resumable(tmp_path, current) is None


@pytest.mark.slow
def test_a_run_with_a_local_tokenizer_is_read_from_another_folder_offline(tmp_path, monkeypatch, capsys):
    """The issue's walk (offline, HF_HUB_OFFLINE set by conftest): a tiny LM trained in one folder with
    `--data.init_args.tokenizer moh75` and a relative corpus; from another folder `moh generate` and `moh validate` on
    its checkpoint work, and back in the first, `--ckpt_path last` with a larger budget, `moh75` typed again,
    continues the run and says what changes."""
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir(), other.mkdir()
    monkeypatch.chdir(first)
    train_tokenizer(first / "moh75")
    (first / "my.txt").write_text(TEXT * 40)
    fit = ["fit", "--config", "llm_stdlib_75.yaml", "--data.init_args.sources", "[{path: my.txt, val_fraction: 0.2}]",
           "--data.init_args.tokenizer", "moh75", "--data.init_args.batch_size", "4", "--data.init_args.seq_len", "32",
           "--model.init_args.arch.block_size", "32", "--model.init_args.arch.depth", "1",
           "--model.init_args.arch.embed_dim", "32", "--model.init_args.arch.head_dim", "8",
           "--model.init_args.arch.intermediate_size", "64", "--trainer.val_check_interval", "2",
           "--trainer.limit_val_batches", "1", "--checkpoint.every_n_train_steps", "2",
           "--model.init_args.warmup_steps", "1", "--trainer.enable_progress_bar", "false"]
    moh([*fit, "--model.init_args.max_tokens", str(4 * 4 * 32)])
    checkpoint = run_checkpoints("llm_stdlib_75").resolve() / "last.ckpt"
    monkeypatch.chdir(other)
    texts = generate(checkpoint=str(checkpoint), prompt="def ", max_new_tokens=4, temperature=0)
    assert len(texts) == 1
    capsys.readouterr()
    moh(["validate", "--ckpt_path", str(checkpoint), "--trainer.enable_progress_bar", "false"])
    assert "moh validate: metrics and head load in" in capsys.readouterr().out
    monkeypatch.chdir(first)
    moh([*fit, "--model.init_args.max_tokens", str(8 * 4 * 32), "--ckpt_path", "last"])
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("moh: continuing")]
    assert len(said) == 1 and "max_tokens 512 -> 1024; the learning-rate schedule now spans 8 steps, not 4" in said[0]
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 8


def test_a_local_init_from_is_recorded_resolved_and_compares_so_on_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "moh-qwen").mkdir()
    args = Namespace(init_from="moh-qwen")
    resolve_init_from(args)  # so the run's config.yaml builds the model from any folder
    assert args.init_from == str(tmp_path / "moh-qwen")
    hub = Namespace(init_from="Qwen/Qwen2.5-0.5B")
    resolve_init_from(hub)
    assert hub.init_from == "Qwen/Qwen2.5-0.5B"
    # A config.yaml that kept it as typed resumes the same weights named by their absolute path.
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"init_args": {"init_from": "moh-qwen"}}}))
    assert check_resumable(tmp_path, {"model": {"init_args": {"init_from": str(tmp_path / "moh-qwen")}}}) is None


def test_init_from_weights_that_cannot_load_stop_in_one_line(tmp_path, monkeypatch):
    from transformers import Qwen2Config

    from moh_lightning.cli import user_error
    from moh_lightning.models.hf_causal.network import _from_pretrained

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(OSError) as raised:
        _from_pretrained(str(tmp_path / "gone"), config, None, torch.float32)
    line = user_error("fit", raised.value)
    assert line is not None and line.startswith(f"moh: init_from='{tmp_path / 'gone'}': cannot load its weights")

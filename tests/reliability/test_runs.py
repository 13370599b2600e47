"""Run folders: a run never continues or overwrites another run's weights."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from moh_lightning.cli import main

pytestmark = pytest.mark.slow


def _corpus(folder: Path, seed: int) -> Path:
    """A few Python-looking files, different for each seed."""
    folder.mkdir()
    rng = torch.Generator().manual_seed(seed)
    for i in range(6):
        words = torch.randint(0, 50, (1000,), generator=rng).tolist()
        folder.joinpath(f"f{i}.py").write_text("\n".join(f"def f{w}(x):\n    return x + {w}" for w in words))
    return folder


def _fit(corpus: Path, *extra: str) -> None:
    sources = f"[{{path: {corpus}, pattern: '*.py', val_fraction: 0.3}}]"
    main(["fit", "--config", "llm_stdlib_75.yaml", "--data.init_args.sources", sources,
          "--model.init_args.max_tokens", "2048", "--data.init_args.batch_size", "4", "--data.init_args.seq_len", "64",
          "--model.init_args.arch.block_size", "64", "--model.init_args.arch.depth", "1",
          "--model.init_args.arch.embed_dim", "64", "--model.init_args.arch.head_dim", "8",
          "--model.init_args.arch.intermediate_size", "128", "--trainer.val_check_interval", "4",
          "--trainer.limit_val_batches", "1", "--checkpoint.every_n_train_steps", "4", *extra])


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


class FailAtStart(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        raise RuntimeError("failed before the first step")


def test_a_run_that_fails_before_it_starts_leaves_no_folder(run_dir):
    with pytest.raises(SystemExit, match="no class folders"):
        main(["fit", "--config", "vit_tiny_folder_digits_75.yaml", "--data.init_args.data_dir", "missing"])
    assert not (run_dir / "runs" / "vit_tiny_folder_digits_75").exists()  # was version_0: an events file, hparams


def test_a_finished_run_is_kept_by_what_cannot_continue_it_and_continues_in_its_own_folder(run_dir, capsys,
                                                                                          recwarn):
    """One finished run (8 steps) and what is done beside it, in turn: resumed with other data, refused in one line;
    the house issue's collision, a run of the same config with other data and another name started with
    --ckpt_path last, which trains from scratch; a fresh run that fails before its first step, no folder; the run
    continued for longer (and more loader workers), in its own folder, with one line on what that does to the
    learning-rate schedule and without Lightning's warning that the checkpoint folder "exists and is not empty" (it
    holds the checkpoints the run continues); resumed under its name with another head budget, refused; a fresh run
    of the config, a new folder, and Lightning's warning where it is no intended resume (a checkpoint folder of the
    user's, holding files)."""
    corpus, other = _corpus(run_dir / "corpus", 0), _corpus(run_dir / "other", 1)
    _fit(corpus)
    run = run_dir / "runs" / "llm_stdlib_75"
    version = run / "version_0"
    first = torch.load(version / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert first["tokens_seen"] == 2048
    files = _snapshot(run)

    before = _snapshot(run_dir / "runs")
    with pytest.raises(SystemExit) as stop:
        _fit(other, "--ckpt_path", "last")
    message = str(stop.value)
    assert "\n" not in message and "data.init_args.sources" in message and "version_0" in message
    assert _snapshot(run_dir / "runs") == before

    _fit(other, "--trainer.logger.init_args.name", "other_run", "--ckpt_path", "last")  # nothing of its own to resume
    assert _snapshot(run) == files  # every file of the first run intact
    saved = torch.load(run_dir / "runs" / "other_run" / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=True)
    assert saved["global_step"] == first["global_step"]  # it trained its full budget from scratch
    assert not torch.equal(saved["state_dict"]["model.embed.weight"], first["state_dict"]["model.embed.weight"])

    before = _snapshot(run_dir / "runs")
    with pytest.raises(RuntimeError, match="before the first step"):
        _fit(corpus, "--trainer.callbacks+=test_runs.FailAtStart")
    assert _snapshot(run_dir / "runs") == before  # the runs stay as they were, and the failed one leaves no version_1
    assert [p.name for p in run.iterdir()] == ["version_0"]

    capsys.readouterr()
    recwarn.clear()
    _fit(corpus, "--model.init_args.max_tokens", "4096", "--data.init_args.num_workers", "1", "--ckpt_path", "last")
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("moh: continuing")]
    assert len(said) == 1 and "model.init_args.max_tokens 2048 -> 4096" in said[0]
    assert "data.init_args.num_workers 0 -> 1" in said[0] and "new order" in said[0]
    assert "the learning-rate schedule now spans 16 steps, not 8: lr at step 8 " in said[0]
    assert not [w for w in recwarn if "exists and is not empty" in str(w.message)]
    assert "max_tokens 2048 -> 4096" in (version / "resumes.log").read_text()
    assert [p.name for p in run.iterdir()] == ["version_0"]
    resumed = torch.load(version / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["tokens_seen"] == 4096 and resumed["global_step"] == 2 * first["global_step"]

    # Another head budget is another experiment: by default a run of its own name (llm_stdlib_62), and under the
    # same name, refused.
    with pytest.raises(SystemExit) as stop:
        _fit(corpus, "--model.init_args.max_tokens", "2048", "--model.init_args.arch.moh.top_k", "1",
             "--trainer.logger.init_args.name", "llm_stdlib_75", "--ckpt_path", "last")
    assert "model.init_args.arch.moh.top_k" in str(stop.value) and "max_tokens" not in str(stop.value)

    (run_dir / "kept").mkdir()
    (run_dir / "kept" / "old.ckpt").write_bytes(b"")
    recwarn.clear()
    _fit(corpus, "--model.init_args.max_tokens", "512", "--checkpoint.dirpath", "kept")  # without --ckpt_path
    assert sorted(p.name for p in run.iterdir()) == ["version_0", "version_1"]
    assert [w for w in recwarn if "Checkpoint directory" in str(w.message) and "exists and is not empty" in
            str(w.message)]

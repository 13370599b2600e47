"""A run folder's config.yaml is the run's settings, not the checkpoint it started from."""
from __future__ import annotations

from types import SimpleNamespace

import yaml
from jsonargparse import ArgumentParser

import moh_lightning.callbacks.logger_runs as logger_runs


def test_a_resumed_runs_config_yaml_does_not_resume_when_read_back(tmp_path, monkeypatch):
    parser = ArgumentParser()
    parser.add_argument("--ckpt_path", type=str | None)
    parser.add_argument("--max_tokens", type=int)
    resumed = parser.parse_args(["--ckpt_path", "runs/lm/version_0/checkpoints/last.ckpt", "--max_tokens", "7680"])
    monkeypatch.setattr(logger_runs, "run_folder", lambda trainer: tmp_path)
    callback = logger_runs.SaveRunConfig(parser, resumed, overwrite=True)
    callback.setup(SimpleNamespace(is_global_zero=True, datamodule=None), None, "fit")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved == {"ckpt_path": None, "max_tokens": 7680}  # `moh fit --config` of it starts a run, not continues
    assert resumed.ckpt_path == "runs/lm/version_0/checkpoints/last.ckpt"  # the running fit's own config untouched

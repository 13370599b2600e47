"""The sweep tests' tiny `moh fit` (the shipped embedded LM made tiny by one overlay) and what they read back."""
from __future__ import annotations

import csv
from pathlib import Path

# The only place naming `moh fit` config keys: the shipped embedded LM config, made tiny by one overlay. When keys
# are renamed, update them here (see `moh fit --config llm_stdlib_75.yaml --print_config`).
FIT_CONFIG = "llm_stdlib_75.yaml"


def tiny_overlay(tmp: Path, steps: int, every: int) -> dict:
    """``steps`` training steps, a checkpoint and a validation every ``every``. The model is dense: what a sweep does
    with its trials is the same for any model, and a dense one draws no head-load figures (seconds a trial)."""
    sources = tmp / "src"
    sources.mkdir()
    for i in range(6):  # ~2 kB of Python per file; a third of the files are held out for validation
        (sources / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x * {(i * 37 + j) % 97} + {j}\n\n"
                                                  for j in range(60)))
    return {
        "trainer": {"val_check_interval": every, "log_every_n_steps": 1, "enable_progress_bar": False,
                    "enable_model_summary": False},
        "checkpoint": {"every_n_train_steps": every},
        "model": {"init_args": {
            "arch": {"depth": 1, "embed_dim": 32, "num_heads": 4, "head_dim": 8, "intermediate_size": 64,
                     "block_size": 32, "moh": None},
            "warmup_steps": 2,
            "max_tokens": steps * 4 * 32,  # steps of 4 x 32 tokens
        }},
        "data": {"init_args": {"sources": [{"path": str(sources), "pattern": "*.py", "val_fraction": 0.35}],
                               "cache_dir": str(tmp / "token_cache"), "seq_len": 32, "batch_size": 4,
                               "val_samples": 8}},
    }


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def run_state(run: Path) -> dict:
    """What a trial's run folder holds: its version folders and each file's modification time."""
    return {"versions": sorted(p.name for p in run.glob("version_*")),
            "files": {str(p.relative_to(run)): p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}}

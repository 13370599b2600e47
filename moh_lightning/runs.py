"""Run folders: each run writes its events, resolved config and checkpoints under ``<save_dir>/<name>/version_N/``.

``--ckpt_path last`` continues the newest checkpoint of one run name, in that run's own folder, and only when the
run's model and data settings are the ones saved with it: a run never continues another experiment's weights, and
no run writes into another run's folder.
"""
from __future__ import annotations

from pathlib import Path

import yaml

# The saved settings that must match for a run to continue from a checkpoint: what the weights and the data are.
RESUME_KEYS = ("model", "data")


def versions(run_root: Path) -> list[Path]:
    """The ``version_N`` folders of one run name, oldest first."""
    found = [p for p in run_root.glob("version_*") if p.is_dir() and p.name.removeprefix("version_").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("version_")))


def latest_checkpoint(run_root: Path) -> tuple[Path, Path] | None:
    """The version folder holding the newest checkpoint of a run name, and that checkpoint; None if there is none.

    ``last.ckpt`` is written with every periodic checkpoint and at the end of fit, so it is the newest state of its
    folder; without it the newest by modification time is taken.
    """
    newest = None
    for version in versions(run_root):
        checkpoints = sorted((version / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
        if not checkpoints:
            continue
        last = version / "checkpoints" / "last.ckpt"
        chosen = last if last.is_file() else checkpoints[-1]
        if newest is None or chosen.stat().st_mtime >= newest[1].stat().st_mtime:
            newest = (version, chosen)
    return newest


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def differing_settings(saved: dict, current: dict) -> list[str]:
    """Keys under ``RESUME_KEYS`` whose values differ between a saved and a current resolved config."""
    old = _flatten({key: saved.get(key) for key in RESUME_KEYS})
    new = _flatten({key: current.get(key) for key in RESUME_KEYS})
    return sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))


def check_resumable(version_dir: Path, current: dict) -> None:
    """Stops with one line when ``current``'s model or data settings differ from those saved in ``version_dir``."""
    saved_file = version_dir / "config.yaml"
    if not saved_file.is_file():
        return
    differing = differing_settings(yaml.safe_load(saved_file.read_text()) or {}, current)
    if differing:
        shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
        raise SystemExit(f"moh: --ckpt_path last would continue {version_dir}, whose saved settings differ in "
                         f"{shown} (see {saved_file}): start a fresh run under another name "
                         f"(--trainer.logger.init_args.name NEW_NAME) or leave out --ckpt_path last.")


__all__ = ["RESUME_KEYS", "check_resumable", "differing_settings", "latest_checkpoint", "versions"]

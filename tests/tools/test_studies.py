"""The shipped study sweeps (`cli_configs/studies/`): every cell builds, and each named budget is what it says."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import yaml

from moh_lightning.configs import config_dir
from moh_lightning.layers import MoHAttention, activated_head_fraction
from moh_lightning.sweep.grid import cli_value, grid_cells
from moh_lightning.trainer_cli import MoHLightningCLI

STUDIES = sorted(p.name for p in (config_dir() / "studies").glob("*.yaml"))


def _built(study: dict, overrides: dict):
    args = ["--config", study["fit_config"], *study.get("extra_args", [])]
    for key, value in overrides.items():
        args += [f"--{key}", cli_value(value)]
    with torch.device("meta"):
        cli = MoHLightningCLI(args=args, run=False)
        if getattr(cli.model, "model", None) is None:
            cli.model.configure_model()
    return cli


def _arch_without_moh(cli) -> dict:
    arch = cli.model.hparams["arch"]
    arch = dict(dataclasses.asdict(arch) if dataclasses.is_dataclass(arch) else arch)
    arch.pop("moh", None)
    return arch


@pytest.mark.slow
@pytest.mark.parametrize("name", STUDIES)
def test_every_study_cell_builds_the_budget_it_is_named_after(name):
    study = yaml.safe_load((config_dir() / "studies" / name).read_text())
    cells, shown = grid_cells(study["grid"])
    assert len(study["seeds"]) >= 3
    unchanged = _arch_without_moh(_built(study, {}))
    for cell, label in zip(cells, shown, strict=True):
        cli = _built(study, cell)
        model = cli.model.model
        # The cell changes the head budget only: the override merges into the config's arch.
        assert _arch_without_moh(cli) == unchanged
        label = label["model.init_args.arch.moh"]
        percent = re.match(r"moh-(\d+)", label)
        routers = [m.router for m in model.modules() if isinstance(m, MoHAttention) and m.is_moh]
        assert bool(routers) == bool(percent), (name, label)
        # The named percentage is the share of heads each token uses over all layers (90% of 4 x 8 heads: 29 of 32).
        assert activated_head_fraction(model) == pytest.approx(int(percent[1]) / 100 if percent else 1.0, abs=0.03)
        if "no-shared" in label:
            assert {r.num_shared_heads for r in routers} == {0}
        if percent:  # the Tab. 6 ablation's switch: the learned shared / routed balance of Eq. 6
            two_stage = "one-stage" not in label and "no-shared" not in label
            mixed = [r for r in routers if r.num_shared_heads and r.num_routed_heads]  # only these have a balance
            assert all((r.type_router is not None) == two_stage for r in mixed), (name, label)
            assert bool(mixed) == ("no-shared" not in label), (name, label)

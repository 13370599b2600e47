"""``TASKS``, the task registry, drives the task × test matrix: each registered task ships a recipe and experiments
that build it, and is a case of the DDP and FSDP runs (``tests/reliability``), which parametrize over ``TASKS``, so
a task added without its cases fails there rather than going untested."""
from __future__ import annotations

import importlib

import pytest

from moh_lightning.configs import config_dir, load_config, shipped_configs
from moh_lightning.tasks import TASKS, MoHTask


def _task_class(name: str) -> type | None:
    """The task class a config builds (its ``model.class_path``, with everything it extends)."""
    path = (load_config(name).get("model") or {}).get("class_path")
    if path is None:
        return None
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _builds(name: str, cls: type) -> bool:
    built = _task_class(name)
    return built is not None and issubclass(built, cls)


@pytest.mark.parametrize("task", TASKS)
def test_every_registered_task_is_a_moh_task_with_a_shipped_recipe_and_experiments(task):
    cls = TASKS[task]
    assert issubclass(cls, MoHTask)
    recipes = [f"recipes/{p.name}" for p in sorted(config_dir().glob("recipes/*.yaml"))]
    assert any(_builds(name, cls) for name in recipes), f"{task}: no recipe in cli_configs/recipes/ builds it"
    assert any(_builds(name, cls) for name in shipped_configs()), f"{task}: no experiment in cli_configs/ builds it"


@pytest.mark.parametrize("name", shipped_configs())
def test_every_shipped_experiment_builds_a_registered_task(name):
    built = _task_class(name)
    assert built is not None and any(issubclass(built, cls) for cls in TASKS.values()), f"{name} builds {built}"

"""The private timm names the suite relies on still exist, and only ``models/timm_compat.py`` imports them.

When this fails after a timm upgrade, adapt ``moh_lightning/models/timm_compat.py`` (or cap timm in
pyproject.toml).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import moh_lightning
from moh_lightning.models.timm_compat import PRIVATE_TIMM_NAMES, feature_take_indices

PACKAGE = Path(moh_lightning.__file__).parent


@pytest.mark.parametrize("path", PRIVATE_TIMM_NAMES)
def test_private_timm_name_exists(path: str) -> None:
    module, name = path.rsplit(".", 1)
    assert hasattr(importlib.import_module(module), name), f"{path} is gone from the installed timm"


def test_feature_take_indices_keeps_the_contract_transnext_uses():
    assert feature_take_indices(4, None) == ([0, 1, 2, 3], 3)
    assert feature_take_indices(4, 2) == ([2, 3], 3)  # an int: the last n
    assert feature_take_indices(4, [0, -1]) == ([0, 3], 3)


def _private_timm_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        modules = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                   else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
        names += [m for m in modules if m.split(".")[0] == "timm" and any(p.startswith("_") for p in m.split("."))]
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("timm"):
            names += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return names


def test_only_timm_compat_imports_private_timm_names():
    offenders = {str(path.relative_to(PACKAGE)): names for path in PACKAGE.rglob("*.py")
                 if path.name != "timm_compat.py" and (names := _private_timm_imports(path))}
    assert offenders == {}

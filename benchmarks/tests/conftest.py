import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# The scripts import as ``benchmarks.<name>`` from the repository's root, also under a bare ``pytest`` (which, unlike
# ``python -m pytest``, does not put the working folder on the path).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Two threads at most: the suite runs on a 2-core CI machine.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """An empty working folder, so relative outputs land in tmp and shipped configs resolve by name."""
    monkeypatch.chdir(tmp_path)
    return tmp_path

import os

import pytest
import torch

# Two threads at most: the suite runs on a 2-core CI machine, its cores shared out among pytest-xdist's workers
# (tests/conftest.py).
torch.set_num_threads(max(1, min(2, torch.get_num_threads(),
                                 (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """An empty working folder, so relative outputs land in tmp and shipped configs resolve by name."""
    monkeypatch.chdir(tmp_path)
    return tmp_path

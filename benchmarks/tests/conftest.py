import pytest
import torch

# Two threads at most: the suite runs on a 2-core CI machine.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """An empty working folder, so relative outputs land in tmp and shipped configs resolve by name."""
    monkeypatch.chdir(tmp_path)
    return tmp_path

"""One reader for other people's weights: the file or hub id, what wraps the network's weights, the fit report."""
import pytest
import torch

from moh_lightning.weights import check_fit, read_state_dict, unwrap


def test_unwrap_takes_the_ema_weights_of_a_training_checkpoint_and_strips_ddp_and_task_prefixes():
    weights = {"w": torch.ones(1)}
    assert unwrap({"model": {"module.w": torch.zeros(1)}, "ema": weights})["w"].item() == 1.0
    assert unwrap({"module.w": torch.ones(1)}).keys() == {"w"}
    fit = {"pytorch-lightning_version": "2.6", "state_dict": {"model.w": torch.ones(1)}}
    assert unwrap(fit).keys() == {"w"}
    assert unwrap({"model.w": torch.ones(1)}).keys() == {"model.w"}     # a bare state dict keeps its names


def test_read_state_dict_reads_safetensors_and_torch_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, tmp_path / "w.safetensors")
    torch.save({"state_dict": {"a": torch.ones(2)}}, tmp_path / "w.pth")
    for name in ("w.safetensors", "w.pth"):
        assert torch.equal(read_state_dict(tmp_path / name, "key")["a"], torch.ones(2))
    with pytest.raises(FileNotFoundError, match="key=.*no such weights file"):
        read_state_dict(tmp_path / "absent.pth", "key")


def test_check_fit_names_missing_unexpected_and_mis_shaped_keys_in_one_line():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    state = {"0.weight": torch.zeros(3, 2), "1.weight": torch.zeros(2, 3), "extra": torch.zeros(1)}
    with pytest.raises(ValueError) as error:
        check_fit(model, state, "src", "match the sizes.", fresh=lambda name: name == "1.bias")
    message = str(error.value)
    assert "\n" not in message and message.startswith("src does not fit this model")
    assert "1 missing ['0.bias']" in message and "1 unexpected ['extra']" in message
    assert "1.weight (2, 3) vs (1, 3)" in message and message.endswith("match the sizes.")
    check_fit(model, dict(model.state_dict()), "src", "")

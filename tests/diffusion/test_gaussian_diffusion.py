"""DiT's training loss term by term against DiT's own ``training_losses`` (golden values of facebookresearch/DiT's
``diffusion/gaussian_diffusion.py``, tests/make_golden.py): the eps-MSE, the bound term (decoder NLL at t = 0, the KL
after), their sum, and the gradient, in which the bound trains only the variance output."""
from __future__ import annotations

import pytest
import torch
from golden import load_golden
from tiny_models import dit_t4_config

from moh_lightning.tasks.diffusion import ClassConditionalDiffusion


@pytest.fixture(scope="module")
def golden():
    tensors, metadata = load_golden("diffusion")
    assert metadata["source"].startswith("facebookresearch/DiT@")
    return tensors


def _task(schedule: str) -> ClassConditionalDiffusion:
    return ClassConditionalDiffusion(dit_t4_config(depth=1, input_size=4, in_chans=2, num_classes=2),
                                     beta_schedule=schedule)


@pytest.mark.parametrize("schedule", ["linear", "squaredcos_cap_v2"])
def test_noising_loss_terms_and_gradient_equal_dits_training_losses(golden, schedule):
    task = _task(schedule)
    x0, t, noise = golden["x0"], golden["t"], golden["noise"]
    assert (t == 0).sum() == 3 and x0.min() == -1 and x0.max() == 1  # the decoder term and its edge bins are reached
    x_t = task.noise_scheduler.add_noise(x0, noise, t)
    torch.testing.assert_close(x_t, golden[f"{schedule}.x_t"], rtol=1e-5, atol=1e-5)

    output = golden["model_output"].clone().requires_grad_(True)
    terms = task.criterion(output, x0, golden[f"{schedule}.x_t"], t, noise)
    for key in ("mse", "vb", "loss"):
        torch.testing.assert_close(terms[key], golden[f"{schedule}.{key}"], rtol=2e-5, atol=1e-6, msg=key)
    terms["loss"].sum().backward()
    torch.testing.assert_close(output.grad, golden[f"{schedule}.grad"], rtol=1e-5, atol=1e-7)


def test_the_bound_term_passes_no_gradient_to_the_noise_prediction(golden):
    criterion = _task("linear").criterion
    output = golden["model_output"].clone().requires_grad_(True)
    criterion(output, golden["x0"], golden["linear.x_t"], golden["t"], golden["noise"])["vb"].sum().backward()
    channels = golden["x0"].shape[1]
    assert output.grad[:, :channels].abs().max() == 0 and output.grad[:, channels:].abs().max() > 0


def test_the_bound_term_is_not_rescaled_with_the_number_of_steps(golden):
    """DiT's loss type is MSE, not RESCALED_MSE: vb is the bound term itself at any number of training steps."""
    task = ClassConditionalDiffusion(dit_t4_config(depth=1, input_size=4, in_chans=2, num_classes=2),
                                     num_train_timesteps=500)
    x0, t, noise, output = golden["x0"], golden["t"] // 2, golden["noise"], golden["model_output"]
    x_t = task.noise_scheduler.add_noise(x0, noise, t)
    terms = task.criterion(output, x0, x_t, t, noise)
    channels = x0.shape[1]
    expected = task.criterion.variational_bound(x0, x_t, t, output[:, :channels], output[:, channels:])
    torch.testing.assert_close(terms["vb"], expected, rtol=0, atol=0)


def test_terms_are_per_sample_means_whatever_the_image_size(golden):
    """The golden inputs tiled 2 x 2 (8 x 8 images of 2 channels) give DiT's per-sample terms: the variance output is
    told apart by its channels alone; an eps-only output (no variance channels) has no bound term."""
    criterion = _task("linear").criterion
    x0, x_t, noise, output = (golden[k].repeat(1, 1, 2, 2) for k in ("x0", "linear.x_t", "noise", "model_output"))
    terms = criterion(output, x0, x_t, golden["t"], noise)
    for key in ("mse", "vb", "loss"):
        torch.testing.assert_close(terms[key], golden[f"linear.{key}"], rtol=2e-5, atol=1e-6, msg=key)
    eps_only = criterion(output[:, :x0.shape[1]], x0, x_t, golden["t"], noise)
    torch.testing.assert_close(eps_only["mse"], golden["linear.mse"], rtol=2e-5, atol=1e-6)
    assert torch.equal(eps_only["vb"], torch.zeros_like(eps_only["mse"])) and torch.equal(eps_only["loss"],
                                                                                           eps_only["mse"])


def test_the_schedule_is_not_in_checkpoints():
    """The loss's schedule tensors are rebuilt from the task's options, never read back from a checkpoint: a task's
    state dict holds the network alone (a checkpoint of one schedule cannot carry it into another)."""
    task = _task("linear")
    assert len(task.criterion.state_dict()) == 0
    assert not [key for key in task.state_dict() if key.startswith("criterion.")]

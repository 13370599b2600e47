"""DiT's training loss on a diffusers noise schedule: the eps-MSE and the variational-bound term (Nichol & Dhariwal).

Kept apart from the task, as DiT keeps ``diffusion/`` apart from its model: the maths of the forward process and its
bound, no Lightning.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffusers import DDPMScheduler


def _mean_flat(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(1)


def _normal_kl(mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor, logvar2: torch.Tensor) -> torch.Tensor:
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def _approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """ADM's tanh approximation of the standard normal CDF, which DiT's decoder term uses: with the exact CDF the
    t = 0 term moved by up to 3e-4 relative."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def _discretized_gaussian_log_likelihood(x: torch.Tensor, means: torch.Tensor,
                                         log_scales: torch.Tensor) -> torch.Tensor:
    """Log-probability of data in [-1, 1] quantised to 256 bins under a Gaussian (the bound's t = 0 decoder term)."""
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = _approx_standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = _approx_standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


class GaussianDiffusionLoss(torch.nn.Module):
    """DiT's training loss for a learned-variance eps-model on a diffusers noise schedule.

    diffusers' schedulers provide the schedule and the sampling steps but no training losses, so the variational
    bound term of Nichol & Dhariwal (used by DiT as ``loss = mse + vb``) is written here. The variance output v in
    [-1, 1] interpolates log-variance between the clipped posterior variance and beta_t, as ``learned_range``. DiT
    trains with ADM's plain ``MSE`` loss type (``create_diffusion``'s ``rescale_learned_sigmas=False``), so ``vb`` is
    not multiplied by T / 1000 as ``RESCALED_MSE`` would. ``tests/diffusion/test_gaussian_diffusion.py`` compares every
    term and its gradient with DiT's ``training_losses`` (golden values in ``tests/data``).
    """

    def __init__(self, scheduler: DDPMScheduler) -> None:
        super().__init__()
        betas = scheduler.betas.double()
        # From the betas in float64, as DiT: diffusers' float32 cumulative product puts a relative error of ~1e-3 on
        # 1 - alpha_bar near t = 0, which moved the bound's t = 0 decoder term by up to 2% (cosine schedule).
        alphas_cumprod = torch.cumprod(1.0 - betas, 0)
        alphas_cumprod_prev = torch.cat([alphas_cumprod.new_ones(1), alphas_cumprod[:-1]])
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        # The t = 0 posterior variance is 0; DiT clips its log by repeating the t = 1 value.
        posterior_log_variance = torch.log(torch.cat([posterior_variance[1:2], posterior_variance[1:]]))
        buffers = {
            "sqrt_recip_alphas_cumprod": torch.sqrt(1.0 / alphas_cumprod),
            "sqrt_recipm1_alphas_cumprod": torch.sqrt(1.0 / alphas_cumprod - 1.0),
            "posterior_mean_coef1": betas * torch.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod),
            "posterior_mean_coef2": (1.0 - alphas_cumprod_prev) * torch.sqrt(1.0 - betas) / (1.0 - alphas_cumprod),
            "posterior_log_variance": posterior_log_variance,
            "log_betas": torch.log(betas),
        }
        for name, value in buffers.items():
            self.register_buffer(name, value.float(), persistent=False)
        self.num_timesteps = len(betas)

    def _at(self, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return getattr(self, name)[t].reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)

    def variational_bound(self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor,
                          var_values: torch.Tensor) -> torch.Tensor:
        """Per-sample bound term in bits per dimension: KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t)), decoder NLL at t=0."""
        pred_x0 = (self._at("sqrt_recip_alphas_cumprod", t, x_t) * x_t
                   - self._at("sqrt_recipm1_alphas_cumprod", t, x_t) * eps)
        coef1, coef2 = self._at("posterior_mean_coef1", t, x_t), self._at("posterior_mean_coef2", t, x_t)
        model_mean = coef1 * pred_x0 + coef2 * x_t
        true_mean = coef1 * x0 + coef2 * x_t
        min_log = self._at("posterior_log_variance", t, x_t)
        frac = (var_values + 1) / 2
        model_log_variance = frac * self._at("log_betas", t, x_t) + (1 - frac) * min_log
        kl = _mean_flat(_normal_kl(true_mean, min_log, model_mean, model_log_variance)) / math.log(2.0)
        log_likelihood = _discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * model_log_variance)
        nll = -_mean_flat(log_likelihood) / math.log(2.0)
        return torch.where(t == 0, nll, kl)

    def forward(self, model_output: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                noise: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample ``mse``, ``vb`` (zero without a variance output) and their sum ``loss``."""
        channels = x0.shape[1]
        eps = model_output[:, :channels]
        mse = _mean_flat((noise - eps) ** 2)
        if model_output.shape[1] == 2 * channels:
            # The bound trains only the variance: the mean's gradient comes from the MSE alone (eps detached).
            vb = self.variational_bound(x0, x_t, t, eps.detach(), model_output[:, channels:])
        else:
            vb = torch.zeros_like(mse)
        return {"loss": mse + vb, "mse": mse, "vb": vb}


__all__ = ["GaussianDiffusionLoss"]

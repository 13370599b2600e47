"""One training step of a shipped config's network, as the tasks run it. Apart because the CPU report's model
tables, its fresh peak-memory process and the CUDA report all time or measure this same step."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moh_lightning.configs import load_config
from moh_lightning.layers import pop_load_balance_loss


def _shipped_arch(name: str) -> dict:
    """``model.init_args.arch`` of a shipped config with everything it ``extends`` deep-merged under it."""
    config = load_config(f"{name}.yaml")
    return ((config.get("model") or {}).get("init_args") or {}).get("arch") or {}


def model_step_parts(name: str, batch: int, device: torch.device, seq_len: int | None = None):
    """(model in training mode, inputs, loss of the output) of one training step of a shipped config's network."""
    from moh_lightning.models.dit import DiT, DiTConfig
    from moh_lightning.models.llama import LlamaConfig, MoHLlama
    from moh_lightning.models.vit import ViTConfig, create_vit

    arch = _shipped_arch(name)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name.startswith("vit"):
        config = ViTConfig(**arch)
        model = create_vit(config)
        images = torch.randn(batch, config.in_chans, config.img_size, config.img_size, generator=generator)
        labels = torch.randint(0, config.num_classes, (batch,), generator=generator)
        inputs, target = (images.to(device),), labels.to(device)

        def loss_fn(out):
            return F.cross_entropy(out, target)
    elif name.startswith("dit"):
        config = DiTConfig(**arch)
        model = DiT(config)
        x = torch.randn(batch, config.in_chans, config.input_size, config.input_size, generator=generator)
        t = torch.randint(0, 1000, (batch,), generator=generator)
        y = torch.randint(0, config.num_classes, (batch,), generator=generator)
        noise = torch.randn(x.shape, generator=generator).to(device)
        inputs = (x.to(device), t.to(device), y.to(device))

        def loss_fn(out):  # DiT's eps-MSE (the variance term is a few more elementwise operations)
            return F.mse_loss(out[:, :config.in_chans], noise)
    else:
        config = LlamaConfig(**arch)
        model = MoHLlama(config)
        length = seq_len or config.block_size
        tokens = torch.randint(0, config.vocab_size, (batch, length + 1), generator=generator).to(device)
        # As the task: the model takes the targets, so with its fused kernels it never forms the (B, T, V) logits.
        inputs = (tokens[:, :-1], None, tokens[:, 1:])

        def loss_fn(out):
            return out
    return model.to(device).train(), inputs, loss_fn


def train_step(model, inputs, loss_fn) -> Callable[[], None]:
    """One training step as the tasks run it: loss plus 0.01 x the load-balance loss, backward, AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(*inputs))
        balance = pop_load_balance_loss(model)
        (loss if balance is None else loss + 0.01 * balance).backward()
        optimizer.step()
    return step

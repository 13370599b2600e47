"""Details where the suite follows its references exactly: ADM's sampling steps, DiT's guided channels, transformers'
rotary embedding in bf16. (ADM's IS splits: tests/metrics/test_fidelity.py, against its evaluator's output.)"""
from __future__ import annotations

import pytest
import torch

from moh_lightning.models.dit import DiT, DiTConfig
from moh_lightning.models.llama import RotaryEmbedding, apply_rope
from moh_lightning.tasks.diffusion import ClassConditionalDiffusion

TINY_DIT = DiTConfig(input_size=8, patch_size=4, in_chans=4, embed_dim=32, depth=1, num_heads=2, num_classes=3)


def _adm_respacing(num_timesteps: int, steps: int) -> list[int]:
    """ADM's ``space_timesteps(T, "N")`` for one section, re-computed from guided-diffusion's respace.py."""
    stride = (num_timesteps - 1) / (steps - 1)
    return sorted({round(i * stride) for i in range(steps)}, reverse=True)


def test_ddim_takes_adm_ddim_spacing_and_ddpm_adm_respacing():
    task = ClassConditionalDiffusion(TINY_DIT)
    assert task.sampling_scheduler("ddim", 50).timesteps.tolist() == list(range(980, -1, -20))  # ADM's "ddim50"
    assert task.sampling_scheduler("ddpm", 250).timesteps.tolist() == _adm_respacing(1000, 250)


def test_guidance_on_the_first_channels_only_leaves_the_others_conditional():
    torch.manual_seed(0)
    model = DiT(TINY_DIT).eval()
    for p in model.parameters():  # adaLN-Zero starts every output at 0: give the network some output
        torch.nn.init.normal_(p, std=0.1)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.tensor([0, 2])
    cond = model(x, t, y)
    uncond = model(x, t, torch.full_like(y, 3))
    three = model.forward_with_cfg(x, t, y, 4.0, channels=3)
    every = model.forward_with_cfg(x, t, y, 4.0)
    torch.testing.assert_close(three[:, :3], uncond[:, :3] + 4.0 * (cond[:, :3] - uncond[:, :3]))
    torch.testing.assert_close(three[:, 3:], cond[:, 3:])
    torch.testing.assert_close(every[:, :4], uncond[:, :4] + 4.0 * (cond[:, :4] - uncond[:, :4]))
    with pytest.raises(ValueError, match="cfg_channels"):
        ClassConditionalDiffusion(TINY_DIT, cfg_channels=5)


def test_rotary_embedding_in_bf16_matches_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 64, 32).bfloat16(), torch.randn(2, 4, 64, 32).bfloat16()
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=64)
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(q, torch.arange(64)[None])
    expected = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    cos, sin = RotaryEmbedding(32)(0, 64)
    assert torch.equal(apply_rope(q, cos, sin), expected[0]) and torch.equal(apply_rope(k, cos, sin), expected[1])

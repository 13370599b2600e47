"""Small test-only model configs, shared by the test files instead of repeated in each.

The tiny decoders (2 layers, width 64, 4 heads of 16, byte vocabulary) at 100 / 75 / 50% of heads and DiT-T/4 (the
MNIST DiT of ``cli_configs/dit_mnist_*.yaml``) with its MoH budgets.
"""
from __future__ import annotations

from dataclasses import replace

from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.dit import DiTConfig
from moh_lightning.models.llama import LlamaConfig

TINY_LLM = {"vocab_size": 259, "depth": 2, "embed_dim": 64, "num_heads": 4, "head_dim": 16,
            "intermediate_size": 128, "block_size": 64}
# name -> head budget of the tiny decoders: 4 heads, dense / 2 shared + top-1 of 2 / 1 shared + top-1 of 3.
TINY_LLM_BUDGETS: dict[str, MoHConfig | None] = {
    "tiny_100": None,
    "tiny_75": MoHConfig(num_shared_heads=2, top_k=1),
    "tiny_50": MoHConfig(num_shared_heads=1, top_k=1),
}

DIT_T4 = {"input_size": 32, "patch_size": 4, "in_chans": 1, "num_classes": 10, "embed_dim": 128, "depth": 4,
          "num_heads": 8}
# name -> head budget of DiT-T/4: dense, 29 of 32 heads (90%), 24 of 32 heads (75%).
DIT_T4_BUDGETS: dict[str, MoHConfig | None] = {
    "DiT-T/4": None,
    "MoH-DiT-T/4-90": MoHConfig(num_shared_heads=[4, 4, 8, 8], top_k=[2, 3, 0, 0]),
    "MoH-DiT-T/4-75": MoHConfig(num_shared_heads=[3, 4, 4, 4], top_k=[2, 2, 2, 3]),
}


def tiny_llama_config(name: str = "tiny_75", **overrides) -> LlamaConfig:
    """A tiny decoder config (``TINY_LLM_BUDGETS``'s head budget) with keyword overrides of ``LlamaConfig``.

    ``router`` overrides the budget's router (e.g. ``"query_norm"``).
    """
    moh = TINY_LLM_BUDGETS[name]
    router = overrides.pop("router", None)
    if moh is not None:  # a copy: a test that changes its model's budget changes no other test's
        moh = replace(moh, **({"router": router} if router is not None else {}))
    return LlamaConfig(**{**TINY_LLM, "moh": moh, **overrides})


def dit_t4_config(name: str = "DiT-T/4", **overrides) -> DiTConfig:
    """DiT-T/4 (``DIT_T4_BUDGETS``'s head budget) with keyword overrides of ``DiTConfig``."""
    moh = DIT_T4_BUDGETS[name]
    return DiTConfig(**{**DIT_T4, "moh": replace(moh) if moh is not None else None, **overrides})


__all__ = ["DIT_T4", "DIT_T4_BUDGETS", "TINY_LLM", "TINY_LLM_BUDGETS", "dit_t4_config",
           "tiny_llama_config"]

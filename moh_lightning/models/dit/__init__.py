"""Diffusion Transformer (DiT, Peebles & Xie, ICCV 2023) with Mixture-of-Head attention in every block (MoH-DiT).

``config`` holds the sizes and per-block head budget, ``network`` the DiT itself, and ``weights`` the authors'
checkpoint layouts (a dense DiT, the MoH-DiT). The named models are the shipped configs in ``cli_configs/``.
"""
from moh_lightning.models.dit.config import DiTConfig
from moh_lightning.models.dit.network import (
    DiT,
    DiTBlock,
    FinalLayer,
    LabelEmbedder,
    TimestepEmbedder,
    sincos_pos_embed_2d,
)
from moh_lightning.models.dit.weights import (
    ROUTER_NAMES,
    authors_to_dit_state_dict,
    load_authors_dit,
    load_authors_weights,
    load_dense_dit_weights,
    read_state_dict,
)

__all__ = ["ROUTER_NAMES", "DiT", "DiTBlock", "DiTConfig", "FinalLayer", "LabelEmbedder", "TimestepEmbedder",
           "authors_to_dit_state_dict", "load_authors_dit", "load_authors_weights", "load_dense_dit_weights",
           "read_state_dict", "sincos_pos_embed_2d"]

"""The named MoH-ViTs (the paper's budgets on ViT-S/B), registered with timm on ``import moh_lightning``.

Apart from the network because the names are a table of configs, not a network: ``timm.create_model(
"moh_vit_small_patch16_224_75")`` builds one with timm's ViT interface (``features_only``, ``forward_intermediates``,
FX feature extraction, ``torch.export``). The budgets are those of the shipped ``vit_{s,b}_*`` configs.
"""
from __future__ import annotations

from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models.vision_transformer import VisionTransformer

from moh_lightning.models.registry import NamedModel, register_family
from moh_lightning.models.vit.config import ViTConfig
from moh_lightning.models.vit.network import create_vit

_BASE = {"embed_dim": 768, "num_heads": 12}
GENERIC_VIT = "moh_vit"

# Each row: the ViTConfig fields that differ from its defaults (ViT-S/16 at 224).
NAMED_VITS: dict[str, NamedModel] = {
    "moh_vit_small_patch16_224_80": NamedModel(
        {"moh": {"num_shared_heads": 2, "top_k": [3] * 10 + [2] * 2}},
        "MoH-ViT-S/16, 80.6% heads: 2 shared + top-3 of 4 in layers 0-9, top-2 in 10-11 (vit_s_80.yaml)."),
    "moh_vit_small_patch16_224_75": NamedModel(
        {"moh": {"num_shared_heads": 2, "top_k": [3] * 6 + [2] * 6}},
        "MoH-ViT-S/16, 75% heads: 2 shared + top-3 of 4 in layers 0-5, top-2 in 6-11 (vit_s_75.yaml)."),
    "moh_vit_base_patch16_224_75": NamedModel(
        {**_BASE, "moh": {"num_shared_heads": 4, "top_k": 5}},
        "MoH-ViT-B/16, 75% heads: 4 shared + top-5 of 8 in every layer (vit_b_75.yaml)."),
    "moh_vit_base_patch16_224_50": NamedModel(
        {**_BASE, "moh": {"num_shared_heads": 2, "top_k": 4}},
        "MoH-ViT-B/16, 50% heads: 2 shared + top-4 of 10 in every layer (vit_b_50.yaml)."),
    # What `moh export-timm` names a network that is none of the above: its model_args give every field that differs
    # from ViTConfig's defaults, so timm rebuilds it from its config.json alone.
    GENERIC_VIT: NamedModel(
        {}, "A ViT of any shape and head budget (MoH or dense): `model_args` give the ViTConfig fields."),
}


def named_vit_config(name: str, **overrides: Any) -> ViTConfig:
    """The config of a named MoH-ViT, with ``overrides`` (e.g. ``num_classes``) on top."""
    if name not in NAMED_VITS:
        raise ValueError(f"unknown MoH-ViT {name!r}: choose one of {', '.join(NAMED_VITS)}.")
    return ViTConfig(**{**NAMED_VITS[name].fields, **overrides})


def _cfg(name: str) -> dict:
    return {
        "num_classes": 1000, "input_size": (3, 224, 224), "crop_pct": 0.875, "interpolation": "bicubic",
        "fixed_input_size": True, "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0",
        "paper_ids": "arXiv:2410.11842",
    }


def _build(name: str, **fields: Any) -> VisionTransformer:
    return create_vit(named_vit_config(name, **fields))


# As timm's own ViTs, features_only returns the last three blocks unless told.
register_family(__package__, NAMED_VITS, _build, _cfg, out_indices=3)

__all__ = ["GENERIC_VIT", "NAMED_VITS", "named_vit_config"]

"""The named TransNeXts (the paper's MoH-ViTs and TransNeXt's dense sizes), registered with timm on import.

Apart from the network because the names are a table of configs, not a network: ``timm.create_model(
"moh_transnext_small_75")`` builds one with timm's backbone interface (``features_only``, ``forward_intermediates``,
FX feature extraction, ``torch.export``), and ``pretrained=True`` reads the authors' layout through ``weights``. The
MoH budgets are the authors' (SkyworkAI/MoH, ``MoH-ViT/transnext.py``): every head shared in the first two stages,
shared heads plus top-k routed ones in the last two.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from moh_lightning.models.registry import NamedModel, register_family
from moh_lightning.models.transnext.config import NUM_STAGES, TransNeXtConfig
from moh_lightning.models.transnext.network import TransNeXt
from moh_lightning.models.transnext.weights import checkpoint_state_dict

_SMALL = {}
GENERIC_TRANSNEXT = "moh_transnext"
_BASE = {"embed_dim": [96, 192, 384, 768], "depth": [5, 5, 23, 5], "num_heads": [4, 8, 16, 32], "drop_path_rate": 0.6}
_MICRO = {"embed_dim": [48, 96, 192, 384], "depth": [2, 2, 15, 2], "num_heads": [2, 4, 8, 16], "drop_path_rate": 0.15}


def _moh(shared: list[int], top_k: list[int]) -> dict:
    return {"moh": {"num_shared_heads": shared, "top_k": top_k}}


# Each row: the TransNeXtConfig fields that differ from its defaults (TransNeXt-S), and where the authors published its
# weights (their layout).
NAMED_MODELS: dict[str, NamedModel] = {
    "transnext_small": NamedModel(
        _SMALL, "TransNeXt-S (dense multi-head attention), 49.7M parameters.",
        "DaiShiResearch/transnext-small-224-1k"),
    "transnext_base": NamedModel(
        _BASE, "TransNeXt-B (dense multi-head attention), 89.7M parameters.",
        "DaiShiResearch/transnext-base-224-1k"),
    "transnext_micro": NamedModel(
        _MICRO, "TransNeXt-Micro (dense multi-head attention), 12.8M parameters.",
        "DaiShiResearch/transnext-micro-224-1k"),
    "moh_transnext_small_80": NamedModel(
        {**_SMALL, **_moh([3, 6, 3, 8], [0, 0, 6, 12])},
        "MoH-ViT-S at 80% heads (paper Tab. 1): TransNeXt-S, heads shared [3, 6, 3, 8] + top-k [0, 0, 6, 12].",
        "Chat-UniVi/MoH-ViT-S-80"),
    "moh_transnext_small_75": NamedModel(
        {**_SMALL, **_moh([3, 6, 3, 4], [0, 0, 6, 12])},
        "MoH-ViT-S at 75% heads (paper Tab. 1): TransNeXt-S, heads shared [3, 6, 3, 4] + top-k [0, 0, 6, 12].",
        "Chat-UniVi/MoH-ViT-S-75"),
    "moh_transnext_base_75": NamedModel(
        {**_BASE, **_moh([4, 8, 4, 5], [0, 0, 8, 16])},
        "MoH-ViT-B at 75% heads (paper Tab. 1): TransNeXt-B, heads shared [4, 8, 4, 5] + top-k [0, 0, 8, 16].",
        "Chat-UniVi/MoH-ViT-B-75"),
    "moh_transnext_base_50": NamedModel(
        {**_BASE, **_moh([2, 2, 2, 4], [2, 4, 6, 8])},
        "MoH-ViT-B at 50% heads (paper Tab. 1): TransNeXt-B, heads shared [2, 2, 2, 4] + top-k [2, 4, 6, 8].",
        "Chat-UniVi/MoH-ViT-B-50"),
    # Not a model of the paper: TransNeXt-Micro's sizes at about 75% of the heads, small enough for a CPU.
    "moh_transnext_micro_75": NamedModel(
        {**_MICRO, **_moh([2, 4, 2, 3], [0, 0, 4, 8])},
        "TransNeXt-Micro at 75.6% heads (not in the paper; CPU-sized): shared [2, 4, 2, 3] + top-k [0, 0, 4, 8]."),
    # What `moh export-timm` names a network that is none of the above: its model_args give every field that differs
    # from this row (MoH-ViT-S-75's), so timm rebuilds it from its config.json alone.
    GENERIC_TRANSNEXT: NamedModel(
        {**_SMALL, **_moh([3, 6, 3, 4], [0, 0, 6, 12])},
        "A TransNeXt of any shape and head budget (MoH or dense): `model_args` give the fields that differ from "
        "moh_transnext_small_75's."),
}

#: The named models whose weights their authors published, and where.
AUTHORS_HUB_IDS = {name: row.hub_id for name, row in NAMED_MODELS.items() if row.hub_id}


def transnext_config(name: str, **overrides: Any) -> TransNeXtConfig:
    """The config of a named model, with ``overrides`` (e.g. ``num_classes``) on top."""
    if name not in NAMED_MODELS:
        raise ValueError(f"unknown TransNeXt model {name!r}: choose one of {', '.join(NAMED_MODELS)}.")
    return TransNeXtConfig(**{**NAMED_MODELS[name].fields, **overrides})


def config_arguments(arch: TransNeXtConfig, name: str) -> dict:
    """The fields of ``arch`` that differ from the named model's: what rebuilds ``arch`` from ``name``."""
    base, ours = asdict(transnext_config(name)), asdict(arch)
    return {key: value for key, value in ours.items() if value != base[key]}


def _cfg(name: str) -> dict:
    origin = NAMED_MODELS[name].hub_id
    return {
        "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": (7, 7), "crop_pct": 0.875,
        "interpolation": "bicubic", "fixed_input_size": True, "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD, "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0",
        "paper_ids": "arXiv:2410.11842" if name.startswith("moh") else "arXiv:2311.17132",
        "origin_url": f"https://huggingface.co/{origin}" if origin else None,
    }


def _build(name: str, **fields: Any) -> TransNeXt:
    return TransNeXt(transnext_config(name, **fields))


def _filter_state_dict(state_dict: dict, model: TransNeXt) -> dict:
    """timm's hook on pretrained weights: a suite / timm-export file as it is, an authors' checkpoint converted."""
    return checkpoint_state_dict(state_dict)


# features_only takes the four stages' maps unless told, the stages after the last one asked for dropped.
register_family(__package__, NAMED_MODELS, _build, _cfg, out_indices=tuple(range(NUM_STAGES)),
                pretrained_filter_fn=_filter_state_dict)

__all__ = ["AUTHORS_HUB_IDS", "GENERIC_TRANSNEXT", "NAMED_MODELS", "config_arguments", "transnext_config"]

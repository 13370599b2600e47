"""TransNeXt checkpoints in any layout (ours, a timm export, the authors') into the network, every tensor used.

Apart from the network because a checkpoint layout is a naming convention of someone else's code, not part of the
model: the authors' MoH-ViT (SkyworkAI/MoH) and TransNeXt (DaiShiResearch/TransNeXt) checkpoints name their modules
per stage (``patch_embed1``, ``block1.0``, ``norm1`` ...); the aggregated attention has separate ``q`` and ``kv``
projections (ours: one ``qkv``, the same rows in the same order), its MLP bias is ``cpb_fc1`` / ``cpb_fc2``, its
pooled-token norm is ``attn.norm`` (ours: ``pool_norm``, as ``attn.norm`` is ``MoHAttention``'s), the GLU's depthwise
convolution sits one level deeper (``mlp.dwconv.dwconv``), and the routers are ``wg`` (routed heads), ``wg_0``
(shared / routed balance) and ``wg_1`` (shared heads). Their geometry buffers are not saved; ours are recomputed.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from moh_lightning.models.transnext.network import TransNeXt
from moh_lightning.serialization import read_weights_file
from moh_lightning.weights import check_fit, weights_path

_AUTHORS_STAGE = re.compile(r"^(patch_embed|block|norm)([1-4])\.(.*)$")
_AUTHORS_ATTENTION = {"wg.": "router.routed_router.", "wg_0.": "router.type_router.",
                      "wg_1.": "router.shared_router.", "cpb_fc1.": "cpb.fc1.", "cpb_fc2.": "cpb.fc2.",
                      "norm.": "pool_norm."}
_GEOMETRY_BUFFERS = ("relative_pos_index", "relative_coords_table", "seq_length_scale", "padding_mask")


def is_authors_layout(state_dict: dict) -> bool:
    """Whether the names are the authors' (``block1.0.attn...``) rather than ours (``stages.0.blocks.0.attn...``)."""
    return any(_AUTHORS_STAGE.match(key) for key in state_dict)


def from_authors_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A (MoH-)TransNeXt state dict under the authors' names -> the same tensors under this module's names.

    Names it does not know are kept as they are, so that loading reports them as unexpected.
    """
    out, q_parts = {}, {}
    for key, tensor in state_dict.items():
        if key.split(".")[-1].rstrip("1234") in _GEOMETRY_BUFFERS:
            continue
        match = _AUTHORS_STAGE.match(key)
        if match is None:
            out[key] = tensor
            continue
        kind, stage, rest = match.group(1), int(match.group(2)) - 1, match.group(3)
        if kind == "patch_embed":
            out[("patch_embed." if stage == 0 else f"stages.{stage}.downsample.") + rest] = tensor
        elif kind == "norm":
            out[f"stages.{stage}.norm.{rest}"] = tensor
        else:
            block, _, name = rest.partition(".")
            prefix = f"stages.{stage}.blocks.{block}."
            if name.startswith("mlp.dwconv.dwconv."):
                name = "mlp.dwconv." + name.removeprefix("mlp.dwconv.dwconv.")
            elif name.startswith("attn."):
                attn = name.removeprefix("attn.")
                if attn.startswith(("q.", "kv.")):  # joined into qkv below
                    q_parts[(prefix, attn)] = tensor
                    continue
                for theirs, ours in _AUTHORS_ATTENTION.items():
                    if attn.startswith(theirs):
                        attn = ours + attn.removeprefix(theirs)
                        break
                name = "attn." + attn
            out[prefix + name] = tensor
    return {**out, **_joined_qkv(q_parts)}


def _joined_qkv(parts: dict[tuple[str, str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Their aggregated attention's ``q`` and ``kv`` projections, keyed (block prefix, ``q.weight`` ...), as one
    ``qkv``; a half without its other half keeps its name, so that loading reports it as unexpected."""
    out = {}
    for (prefix, attn), tensor in parts.items():
        if not attn.startswith("q."):
            continue
        suffix = attn.removeprefix("q.")
        kv = parts.get((prefix, "kv." + suffix))
        if kv is None:
            out[f"{prefix}attn.q.{suffix}"] = tensor
            continue
        out[f"{prefix}attn.qkv.{suffix}"] = torch.cat([tensor, kv])
    for (prefix, attn), tensor in parts.items():
        if attn.startswith("kv.") and (prefix, "q." + attn.removeprefix("kv.")) not in parts:
            out[f"{prefix}attn.{attn}"] = tensor
    return out


def checkpoint_state_dict(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The network's weights, under our names, from what a checkpoint file holds.

    Accepts a bare state dict (ours, a timm export, or the authors'), the authors' training checkpoint
    (``{"model": ...}``, their released files) and a ``moh fit`` checkpoint (``{"state_dict": {"model.<name>": ...}}``).
    """
    if isinstance(checkpoint.get("model"), dict):
        checkpoint = checkpoint["model"]
    elif isinstance(checkpoint.get("state_dict"), dict):
        checkpoint = {key.removeprefix("model."): value for key, value in checkpoint["state_dict"].items()}
    checkpoint = {key.removeprefix("module."): value for key, value in checkpoint.items()}  # saved under DDP
    return from_authors_state_dict(checkpoint) if is_authors_layout(checkpoint) else checkpoint


def load_pretrained(model: TransNeXt, source: str | Path, key: str = "model.init_args.init_from") -> None:
    """Loads weights (ours, a timm export or the authors') into ``model`` from a file or a hub id (``key`` names the
    option in errors); every tensor must match, none be left."""
    state = checkpoint_state_dict(read_weights_file(weights_path(source, key)))
    check_fit(model, state, str(source), "check that the config names the same model (sizes and head budgets).")
    model.load_state_dict(state)


__all__ = ["checkpoint_state_dict", "from_authors_state_dict", "is_authors_layout", "load_pretrained"]

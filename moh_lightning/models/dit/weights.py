"""DiT checkpoints in their authors' layouts: a dense DiT (facebookresearch/DiT) and the MoH-DiT (SkyworkAI/MoH).

Apart from the network because a checkpoint layout is a naming convention of someone else's code, not part of the
model. The suite's DiT keeps the DiT authors' parameter names, so a dense DiT loads by name, routers fresh. Their
released MoH-DiT-XL/2-90 is the suite's ``dit_xl2_90.yaml`` (the same per-layer heads, head width 72 and head
budgets); its state dict differs from the suite's in two places only:

* the routers of each ``blocks.{i}.attn``: ``wg`` (routed heads, ``Linear(dim, h - h_s)``), ``wg_0`` (shared / routed
  balance, ``Linear(dim, 2)``) and ``wg_1`` (shared heads, ``Linear(dim, h_s)``) are ``router.routed_router``,
  ``router.type_router`` and ``router.shared_router``;
* ``pos_embed`` is a frozen parameter there and a fixed, unsaved buffer here: it is checked to be the sin-cos
  embedding the suite computes, then dropped.

Everything else (patch, timestep and label embedders, ``attn.qkv`` / ``attn.proj`` in the same q-k-v x head x width
order, timm's ``mlp.fc1`` / ``fc2``, ``adaLN_modulation.1``, ``final_layer.*``) has the same names and shapes.

Their gates, term by term against ``MoHRouter`` (``layers/routers.py``), with a token's x:

* routed: ``softmax(wg x)``, the top-``routed_head`` kept (``routed_head`` is their name for k), renormalised over the
  kept with the sum clamped at the dtype's eps, times k: ``MoHRouter``'s routed gates, the same top-k on the same
  softmax;
* shared: ``softmax(wg_1 x) * shared_head``: ``MoHRouter``'s shared gates;
* both groups: shared times ``2 * softmax(wg_0 x)[0]``, routed times ``2 * softmax(wg_0 x)[1]``: ``MoHRouter``'s
  ``type_router`` (first logit for the shared group), built when two-stage routing has both groups;
* layers with k = 0 and every head shared (XL/2-90's first 19 blocks): ``softmax(wg_1 x) * h`` and no ``wg_0``:
  ``MoHRouter`` with no routed heads builds neither ``routed_router`` nor ``type_router``;
* layers with no shared head: routed gates only, as ``MoHRouter`` with ``num_shared_heads=0``.

So the loaded model computes their function with no option added to the router. Their code cannot run a layer with
one shared head and routed heads (it never builds ``wg_1`` there but calls it); the suite gives that head gate 1,
which is what a softmax over one logit would give. ``tests/models/dit/test_dit_authors.py`` checks the loaded model
against a re-computation written from their formulas, and ``results/authors_models.md`` against their own code.
"""
from __future__ import annotations

import torch

from moh_lightning import weights
from moh_lightning.models.dit.config import DiTConfig
from moh_lightning.models.dit.network import DiT, sincos_pos_embed_2d

#: Their router names (in ``blocks.{i}.attn``) -> the suite's (in ``blocks.{i}.attn.router``).
ROUTER_NAMES = {"wg": "routed_router", "wg_0": "type_router", "wg_1": "shared_router"}


def load_dense_dit_weights(model: DiT, source: str) -> DiT:
    """A dense DiT checkpoint in the authors' DiT layout (facebookresearch/DiT: ``DiT-XL-2-256x256.pt``, or a
    ``train.py`` checkpoint, whose EMA weights are used) into a MoH-DiT of the same shape, routers fresh.

    The suite's DiT keeps the DiT authors' parameter names, so every weight loads by name; ``pos_embed`` (a fixed
    sin-cos table here, not a weight) is checked against the model's and dropped. Anything else that is missing,
    left over or of another shape stops in one line.
    """
    key = "model.init_args.init_from"
    state = weights.read_state_dict(source, key)
    config = model.config
    if "pos_embed" in state:
        expected = sincos_pos_embed_2d(config.embed_dim, config.input_size // config.patch_size).unsqueeze(0)
        value = state.pop("pos_embed")
        if value.shape != expected.shape or (value.float() - expected).abs().max().item() > 1e-5:
            raise ValueError(f"{key}={source!r}: its pos_embed {tuple(value.shape)} is not DiT's sin-cos "
                             f"table for this config {tuple(expected.shape)}; check input_size, patch_size, embed_dim.")
    weights.check_fit(model, state, f"{key}={source!r}", "it is not a dense DiT of this config: match depth, "
                      "embed_dim, num_heads, patch_size, in_chans and num_classes to it.",
                      fresh=lambda name: ".router." in name)
    model.load_state_dict(state, strict=False)
    return model


def read_state_dict(source: str) -> dict[str, torch.Tensor]:
    """The weights of a local file or a hub file (``weights.read_state_dict``): a plain state dict, or their
    ``train.py`` checkpoint's EMA weights, the ones their sampling loads (``download.find_model``)."""
    return weights.read_state_dict(source, "--source")


def authors_to_dit_state_dict(state: dict[str, torch.Tensor], config: DiTConfig) -> dict[str, torch.Tensor]:
    """Their MoH-DiT (or DiT) state dict under the suite's ``DiT`` names; ``pos_embed`` checked and dropped."""
    out = {}
    for name, value in state.items():
        prefix, _, leaf = name.rpartition(".")
        block, _, module = prefix.rpartition(".")
        if name == "pos_embed":
            grid = config.input_size // config.patch_size
            expected = sincos_pos_embed_2d(config.embed_dim, grid).unsqueeze(0)
            if value.shape != expected.shape:
                raise ValueError(f"pos_embed has shape {tuple(value.shape)} but the config's {grid}x{grid} patches of "
                                 f"width {config.embed_dim} need {tuple(expected.shape)}: check input_size, patch_size "
                                 f"and embed_dim.")
            gap = (value.float() - expected).abs().max().item()
            if gap > 1e-5:
                raise ValueError(f"pos_embed differs from DiT's fixed sin-cos embedding by {gap:.3g}: this suite keeps "
                                 f"the embedding fixed (not a weight), so these weights cannot be loaded as they are.")
            continue
        if module in ROUTER_NAMES and block.endswith(".attn") and leaf == "weight":
            name = f"{block}.router.{ROUTER_NAMES[module]}.weight"
        out[name] = value
    return out


def load_authors_weights(model: DiT, state: dict[str, torch.Tensor]) -> DiT:
    """Copies the authors' state dict into ``model``; every key of both must be used, with the same shapes."""
    mapped, expected = authors_to_dit_state_dict(state, model.config), model.state_dict()
    missing = [name for name in expected if name not in mapped]
    unexpected = [name for name in mapped if name not in expected]
    reshaped = [f"{name} {tuple(mapped[name].shape)} vs {tuple(value.shape)}" for name, value in expected.items()
                if name in mapped and mapped[name].shape != value.shape]
    if missing or unexpected or reshaped:
        raise ValueError(f"the authors' weights do not match the config: missing {_few(missing)}, unexpected "
                         f"{_few(unexpected)}, other shapes (theirs vs config) {_few(reshaped)}; give the experiment "
                         f"config of that model (per-layer num_heads, head_dim, num_shared_heads and top_k).")
    model.load_state_dict(mapped)
    return model.eval()


def load_authors_dit(source: str | dict[str, torch.Tensor], config: DiTConfig) -> DiT:
    """A ``DiT`` of ``config`` with the authors' weights (a path, hub id or their state dict), every key used."""
    return load_authors_weights(DiT(config), read_state_dict(source) if isinstance(source, str) else source)


def _few(names: list[str], count: int = 6) -> str:
    return str(names[:count])[:-1] + (", ...]" if len(names) > count else "]")


__all__ = ["ROUTER_NAMES", "authors_to_dit_state_dict", "load_authors_dit", "load_authors_weights",
           "load_dense_dit_weights", "read_state_dict"]

"""The golden files of ``tests/data``: outputs of the authors' own code on tiny random-weight models, written by
``tests/make_golden.py`` (which needs their repositories; the tests that read these files do not)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

DATA = Path(__file__).parent / "data"


def load_golden(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors of ``golden_<name>.safetensors`` (fp16-stored weights and inputs cast to the fp32 they were computed
    in) and its metadata (source repository and commit, patches, the network's ``spec`` decoded)."""
    with safe_open(DATA / f"golden_{name}.safetensors", "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        metadata = dict(f.metadata())
    if "spec" in metadata:
        metadata["spec"] = json.loads(metadata["spec"])
    return {key: value.float() if value.dtype == torch.float16 else value for key, value in tensors.items()}, metadata


def prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under ``prefix.``, without it (``weights.`` holds a state dict under the authors' names)."""
    return {key[len(prefix) + 1:]: value for key, value in tensors.items() if key.startswith(prefix + ".")}


def authors_router_shapes(prefix: str, heads: int, shared: int, routed: int, dim: int) -> dict[str, tuple[int, int]]:
    """The router weights of one MoH layer as SkyworkAI/MoH's DiT and TransNeXt create them: ``wg`` scores the routed
    heads (when any is routed), ``wg_0`` weighs the shared and routed groups (when both exist), ``wg_1`` scores the
    shared heads (when more than one)."""
    shapes = {}
    if routed > 0:
        shapes[prefix + "wg.weight"] = (heads - shared, dim)
        if shared > 0:
            shapes[prefix + "wg_0.weight"] = (2, dim)
    if shared > 1:
        shapes[prefix + "wg_1.weight"] = (shared, dim)
    return shapes

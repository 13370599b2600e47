"""Named models registered with timm from a table: the one loop that ViT and TransNeXt share.

timm finds a model by the name of a function that ``register_model`` saw, and that model's pretrained config in the
``default_cfgs`` of the function's module. A family lists its named models as rows of a table and hands the table
here; the entrypoints are made in one loop under the family package's name, so that ``timm.list_models(module="vit")``
lists a family as timm lists its own, and a new named model is one more row.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn


@dataclass(frozen=True)
class NamedModel:
    """One named model of a family.

    Args:
        fields: The config fields that differ from the family config's defaults.
        doc: What the model is, in a line (the entrypoint's docstring).
        hub_id: The Hugging Face hub repo where its authors published weights (their layout), if they did.
    """

    fields: dict[str, Any]
    doc: str
    hub_id: str | None = None


def register_family(package: str, table: Mapping[str, NamedModel], build: Callable[..., nn.Module],
                    cfg: Callable[[str], dict], out_indices: int | tuple[int, ...],
                    pretrained_filter_fn: Callable[[dict, nn.Module], dict] | None = None) -> None:
    """Registers every model of ``table`` with timm under ``package`` (the family's package, being imported).

    ``build(name, **fields)`` makes the network of a named model with ``fields`` on top of its row; ``cfg(name)`` is its
    pretrained config; ``out_indices`` are the blocks or stages ``features_only`` returns unless told;
    ``pretrained_filter_fn`` turns a pretrained file's state dict into the model's names.
    """
    # register_model reads the pretrained configs from the entrypoint's module: the family package, which also holds
    # the entrypoints as timm's model modules hold theirs.
    module = sys.modules[package]
    module.default_cfgs = generate_default_cfgs({name: cfg(name) for name in table})
    for name, row in table.items():
        setattr(module, name, register_model(_entrypoint(package, name, row.doc, build, out_indices,
                                                         pretrained_filter_fn)))


def _entrypoint(package: str, name: str, doc: str, build: Callable[..., nn.Module], out_indices: int | tuple[int, ...],
                pretrained_filter_fn: Callable[[dict, nn.Module], dict] | None) -> Callable[..., nn.Module]:
    def create(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        # As timm's own models: features_only reads the network through forward_intermediates.
        feature_cfg = {"out_indices": kwargs.pop("out_indices", out_indices), "feature_cls": "getter"}
        return build_model_with_cfg(lambda **fields: build(name, **fields), name, pretrained,
                                    pretrained_filter_fn=pretrained_filter_fn, feature_cfg=feature_cfg, **kwargs)

    # timm registers an entrypoint under its function name, and lists it under its module's.
    create.__name__ = create.__qualname__ = name
    create.__module__ = package
    create.__doc__ = doc
    return create


__all__ = ["NamedModel", "register_family"]

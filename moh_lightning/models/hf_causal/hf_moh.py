"""Mixture-of-Head attention for any ``transformers`` causal LM, through its attention interface (remote code).

``moh convert-hf`` and ``moh export-hf`` copy this file beside the weights of a MoH model of any family whose
attention goes through ``transformers.AttentionInterface`` (Qwen2/3, Mistral, Phi-3, Gemma 2, LLaMA, ...), so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` and lm-eval's ``hf`` model load it without
this package. The family's own modelling code runs unchanged: the weights keep its names and its ``config.json`` keeps
every field of the source, plus

* ``model_type: "moh"`` (so that loading without ``trust_remote_code`` stops instead of silently running every head)
  and ``moh_base_model_type``, the family's ``model_type``;
* ``moh_num_shared_heads`` / ``moh_top_k``: the head budget, one int for every layer or a list indexed by the
  attention modules' ``layer_idx``, ``null`` where that layer stays dense (a hybrid's linear-attention or state-space
  layers, which never call the attention interface);
* ``moh_router: "query_norm"`` and ``moh_router_dtype`` (``"float32"``, or ``"activation"`` as the authors' code);
* ``moh_family_attention``, where ``moh convert-hf`` found the suite's head-sparse kernels to compute another attention
  than the family's: those layers' ``layer_idx``, which ``moh_lightning`` runs with the family's attention alone (this
  file always does).

The MoH attention is registered as the implementations ``moh_sdpa`` and ``moh_eager``: each computes the family's
``sdpa`` or ``eager`` attention (softcapping, sliding windows and scalings included) and multiplies each head's output
by its gate before the output projection. Gates are the parameter-free query-norm router's of paper section 4.4: the
first ``moh_num_shared_heads`` heads always 1, and among the others the ``moh_top_k`` heads with the largest query
norm over the standard deviation of those norms 1, the rest 0. The attention interface passes the queries after
rotary embedding, which keeps each head's norm. With every head kept the model computes exactly the family's logits.

This file may import only torch, transformers and the gate's file ``query_norm.py`` (``moh_lightning.layers``'), which
the export copies beside it. ``moh_lightning`` trains such a model by attaching its own routing module (``moh_heads``)
to each attention layer; the registered function hands those layers to it.
"""
from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING

try:  # an exported folder: the gate file the export copies beside this one
    from .query_norm import query_norm_gates
except ImportError:  # this file inside moh_lightning, where that file is the suite's own
    from moh_lightning.layers.query_norm import query_norm_gates

#: The family attention each MoH implementation gates, and the mask it takes.
BASES = {"sdpa": sdpa_mask, "eager": eager_mask}


def layer_budget(config, index: int) -> tuple[int, int] | None:
    """(shared heads, routed heads kept per token) of layer ``index``; None where the layer stays dense."""
    shared, top_k = config.moh_num_shared_heads, config.moh_top_k
    shared = shared[index] if isinstance(shared, list) else shared
    return None if shared is None else (shared, top_k[index] if isinstance(top_k, list) else top_k)


def family_attention(module: torch.nn.Module, base: str):
    """The family's ``base`` attention function: ``sdpa`` from the registry, ``eager`` from the family's modelling
    file, where it may differ from other families' (Gemma 2's soft-caps its scores)."""
    if base == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    return sys.modules[type(module).__module__].eager_attention_forward


def is_attention_layer(module: torch.nn.Module) -> bool:
    """Whether ``module``, calling the attention interface, is one of the family's attention layers, whose heads MoH
    gates: a decoder layer's (``layer_idx``), whatever its class's name (Longcat's ``LongcatFlashMLA``). Other modules
    call the interface without heads over the tokens, and run ungated: Inkling 2's block attention residuals attend
    over the depth's block outputs, one query per position."""
    return hasattr(module, "layer_idx")


def indexed_mask(attention_mask: torch.Tensor, indices: torch.Tensor | None, num_keys: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``attention_mask`` with only the keys a sparse-attention indexer picked for each query (``indices`` (B, T, k),
    as DeepSeek-V3.2, GLM-5, HY-V4 and Mistral Large 3 hand them to the interface) left open: those families mask the
    other keys themselves under ``eager`` and ``sdpa`` alone and hand the indices on to any other implementation (a
    FlashMLA kernel's), the MoH ones included, which would otherwise attend over every key."""
    if indices is None:
        return attention_mask
    dropped = indices.new_ones((*indices.shape[:2], num_keys), dtype=torch.bool).scatter(-1, indices.long(), False)
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~dropped[:, None]
    return attention_mask.masked_fill(dropped[:, None], torch.finfo(dtype).min)


def _moh_attention(base: str):
    def moh_attention(module, query, key, value, attention_mask, **kwargs):
        attention_mask = indexed_mask(attention_mask, kwargs.pop("indices", None), key.shape[2], query.dtype)
        heads = getattr(module, "moh_heads", None)
        if heads is not None:  # a layer moh_lightning trains: its routing module gates and attends
            return heads(module, query, key, value, attention_mask, base=base, **kwargs)
        attention = family_attention(module, base)
        budget = layer_budget(module.config, module.layer_idx) if is_attention_layer(module) else None
        if budget is None:
            return attention(module, query, key, value, attention_mask, **kwargs)
        out, weights = attention(module, query, key, value, attention_mask, **kwargs)
        gates = query_norm_gates(query, *budget, module.config.moh_router_dtype)
        return out * gates[..., None].to(out.dtype), weights                           # (B, T, h, d)

    moh_attention.__name__ = f"moh_{base}_attention"
    return moh_attention


def register() -> None:
    """Registers ``moh_sdpa`` and ``moh_eager`` with transformers' attention and mask interfaces."""
    for base, mask in BASES.items():
        AttentionInterface.register(f"moh_{base}", _moh_attention(base))
        AttentionMaskInterface.register(f"moh_{base}", mask)


def moh_implementation(model_class: type, requested: str | None) -> str:
    """The MoH implementation over ``requested`` (None: the family's default attention, ``sdpa`` where it supports
    it, else ``eager``); an implementation whose output the gates cannot reach stops in one line."""
    base = requested.removeprefix("moh_") if requested else ("sdpa" if model_class._supports_sdpa else "eager")
    if base not in BASES:
        raise ValueError(f"attn_implementation={requested!r}: MoH gates the heads of 'sdpa' or 'eager' attention; "
                         f"load with one of those (or none).")
    if base == "sdpa" and not model_class._supports_sdpa:
        raise ValueError(f"attn_implementation='sdpa': {model_class.__name__} does not support it; load with "
                         f"'eager' (or none).")
    return f"moh_{base}"


def family_config(config_dict: dict, **kwargs):
    """The family's own config class, built from a MoH ``config.json``'s dict (its ``moh_*`` fields kept)."""
    model_type = config_dict.get("moh_base_model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"moh_base_model_type={model_type!r} in config.json: give the model_type of a "
                         f"transformers causal LM family.")
    return CONFIG_MAPPING[model_type].from_dict({k: v for k, v in config_dict.items() if k != "model_type"}, **kwargs)


class MoHConfig(PretrainedConfig):
    """Reads a MoH ``config.json`` as its family's config (``Qwen2Config``, ...), with the ``moh_*`` fields."""

    model_type = "moh"

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        return family_config(config_dict, **kwargs)


class MoHForCausalLM(PreTrainedModel):
    """Loads a MoH folder as its family's ``*ForCausalLM`` with the MoH attention implementation; never built itself.

    ``attn_implementation`` picks the family attention the gates apply to (``sdpa`` or ``eager``).
    """

    config_class = MoHConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, attn_implementation=None, **kwargs):
        family = cls._family(config)
        kwargs.pop("trust_remote_code", None)
        # AutoModelForCausalLM hands a requested implementation over inside the config it read.
        requested = attn_implementation or getattr(config, "_attn_implementation_internal", None)
        return family.from_pretrained(pretrained_model_name_or_path, *args, config=config,
                                      attn_implementation=moh_implementation(family, requested), **kwargs)

    @classmethod
    def _from_config(cls, config, attn_implementation=None, **kwargs):
        family = cls._family(config)
        return family._from_config(config, attn_implementation=moh_implementation(family, attn_implementation),
                                   **kwargs)

    @staticmethod
    def _family(config) -> type:
        register()
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ValueError(f"{type(config).__name__}: not a transformers causal LM family.")
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]

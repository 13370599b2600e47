"""Any ``transformers`` causal LM as a MoH decoder, through transformers' attention interface (paper section 4.4).

``HFCausalLM`` holds the family's own model (``Qwen2ForCausalLM``, ``MistralForCausalLM``, ...) unchanged, loaded with
the MoH attention implementation that ``hf_moh`` registers, and attaches to each attention layer an ``InterfaceHeads``:
the suite's routing module (``layers.MoHHeads``) with the parameter-free query-norm router. The registered attention
function hands each layer's queries (after rotary embedding and the family's norms, which keep each head's norm),
keys, values and mask to it; it gates the heads and attends through the suite's execution dispatch (head-sparse where
it pays, else the family's own attention with the unselected heads zeroed). So the callbacks, the load-balance loss,
exact resume and the exported folder treat such a model as they treat MoH-LLaMA, and every setting of the source
(norm eps, rotary theta and scaling, tied embeddings, biases, sliding windows, soft-capping) is the family's code
reading the source's config.
"""
from __future__ import annotations

import copy
import inspect
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moh_lightning.errors import MissingDataError
from moh_lightning.hf_configs import MOH_MODEL_TYPES, family_config
from moh_lightning.layers import MoHHeads, QueryNormRouter, check_head_budget
from moh_lightning.layers.execution import attend as attend_heads
from moh_lightning.layers.execution import execution_mode
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.decoding import decode

#: Where a composite (vision / audio + text) checkpoint keeps its language model's weights, as the text family's names.
_COMPOSITE_KEYS = {r"^model\.language_model\.": "model.", r"^language_model\.model\.": "model.",
                   r"^language_model\.lm_head\.": "lm_head."}
#: Keyword arguments of the attention interface that the suite's head-sparse kernels do not compute.
_FAMILY_ONLY = ("softcap", "s_aux", "sinks", "position_bias")



def remote_code():
    """``hf_moh``, the file copied into exported folders as their remote code: it imports transformers at its top, so
    it loads when a Hugging Face model is first built, not with the language-model task."""
    from moh_lightning.models.hf_causal import hf_moh

    return hf_moh

class InterfaceHeads(MoHHeads):
    """The MoH routing of one ``transformers`` attention layer, called by the registered MoH attention in its place.

    Args:
        num_heads: The layer's query heads.
        num_kv_heads: Its key / value heads.
        head_dim: The width of one head.
        num_shared_heads: Heads 0..h_s-1, always active.
        top_k: Routed heads kept per token.
        router_dtype: Precision of the query-norm scores (``QueryNormRouter``).
        execution: ``masked``, ``sparse`` or ``auto`` (``layers.execution``).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, num_shared_heads: int, top_k: int,
                 router_dtype: str = "float32", execution: str = "auto") -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal = True
        self.execution = execution_mode(execution, "moh.execution")
        self.router = QueryNormRouter(num_heads, num_shared_heads, check_head_budget(num_heads, num_shared_heads,
                                                                                     top_k), router_dtype)
        #: The layer always attends with the family's own attention: conversion found the suite's kernels to compute
        #: another (``checks.check_layers``: the family reads sinks, biases or scales from the module itself).
        self.family_only = False

    def sequence_length(self, args: tuple) -> int:
        return args[1].shape[2]  # (module, query (B, h, T, d), ...)

    def forward(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, base: str = "sdpa", scaling: float | None = None,
                dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gated head outputs (B, T, h, d) of ``module``'s queries (B, h, T, d) over its keys and values, and the
        family attention's weights when it computed them."""
        gates = self.route(None, query)
        num_queries, num_keys = query.shape[2], key.shape[2]
        decoding = num_keys > num_queries
        if self._suite_core_fits(query, scaling, kwargs) and self._head_sparse(gates, num_queries, num_keys,
                                                                                decoding, causal=True):
            out = self.attend(query, key, value, gates, causal=_causal(query, attention_mask),
                              offset=key.shape[2] - query.shape[2], attn_mask=attention_mask, decoding=decoding,
                              dropout_p=dropout)
            return out, None
        out, weights = remote_code().family_attention(module, base)(module, query, key, value, attention_mask,
                                                              scaling=scaling, dropout=dropout, **kwargs)
        return out * gates[..., None].to(out.dtype), weights

    def suite_difference(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, base: str = "sdpa", scaling: float | None = None,
                         dropout: float = 0.0, **kwargs) -> float | None:
        """The largest difference between the suite's head-sparse kernels and the family's own attention on these
        inputs, every head on, over the family's largest output (0 where both are 0); None where the layer never
        runs the kernels (``_suite_core_fits``). What ``forward`` takes."""
        if not self._suite_core_fits(query, scaling, kwargs, check=True):
            return None
        family, _ = remote_code().family_attention(module, base)(module, query, key, value, attention_mask,
                                                                 scaling=scaling, dropout=0.0, **kwargs)
        ones = query.new_ones(query.shape[0], query.shape[2], self.num_heads)
        suite = attend_heads(query, key, value, ones, head_sparse=True, num_shared_heads=self.num_shared_heads,
                             active_heads=self.num_heads, causal=_causal(query, attention_mask),
                             offset=key.shape[2] - query.shape[2], attn_mask=attention_mask)
        return ((suite.float() - family.float()).abs().max() / family.float().abs().max().clamp_min(1e-30)).item()

    def _suite_core_fits(self, query: torch.Tensor, scaling: float | None, kwargs: dict, check: bool = False) -> bool:
        """Whether the suite's kernels compute this layer's attention: SDPA's scale, none of soft-capping,
        attention sinks or position biases, and no difference at conversion (``family_only``, unless ``check``).
        ``execution='sparse'`` on a layer they cannot compute stops."""
        default_scale = scaling is None or abs(scaling - query.shape[-1] ** -0.5) < 1e-12
        extras = [name for name in _FAMILY_ONLY if kwargs.get(name) is not None]
        fits = default_scale and not extras and (check or not self.family_only)
        if not fits and self.execution == "sparse" and not check:
            reason = (f"its {', '.join(extras)}" if extras else f"its scale {scaling:g} (not 1/sqrt(head_dim))"
                      if not default_scale else "conversion found them to compute another attention in this layer: "
                      "moh_family_attention in config.json")
            raise ValueError(f"moh.execution=sparse: the head-sparse kernels cannot compute this family's attention "
                             f"({reason}); use auto or masked.")
        return fits


def _causal(query: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """No mask from transformers means plain causal attention of the last queries over every key."""
    return attention_mask is None and query.shape[2] > 1


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM with MoH attention in every layer: token ids (B, T) to logits (B, T, vocab).

    Built by ``build_hf_causal``; ``hf`` is the family's model, whose state dict keys are the family's own.
    """

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf.train()  # from_pretrained returns it in eval mode; a new module trains until told
        self.block_size = int(getattr(hf.config, "max_position_embeddings", None) or 2048)

    @property
    def config(self):
        return self.hf.config

    @property
    def blocks(self) -> nn.ModuleList | None:
        """The family's decoder layers (transformers' ``GradientCheckpointingLayer``, what the FSDP configs wrap): the
        repeated blocks that ``compile: auto`` compiles one by one and activation checkpointing recomputes, as the
        suite's models' ``blocks``. None for a family whose layers are not marked so."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        return next((module for module in self.hf.modules() if isinstance(module, nn.ModuleList) and len(module)
                     and all(isinstance(layer, GradientCheckpointingLayer) for layer in module)), None)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``idx`` (B, T), or with ``targets`` (B, T) their mean cross-entropy in float32 (as
        ``MoHLlama``'s, which the task asks for the loss)."""
        logits = self.hf(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k_tokens: int | None = None, top_p: float = 1.0, eos_id: int | None = None,
                 seed: int | None = None) -> torch.Tensor:
        """Continues ``idx`` (B, T) as ``MoHLlama.generate`` does, one token per forward through the family's cache;
        the router runs on every decoded token."""
        from transformers import DynamicCache

        total = min(idx.shape[1] + max_new_tokens, self.block_size)
        cache = DynamicCache(config=self.hf.config)
        return decode(lambda tokens: self.hf(input_ids=tokens, cache=cache, use_cache=True).logits[:, -1], idx, total,
                      temperature, top_k_tokens, top_p, eos_id, seed)


def read_source_config(source: str) -> dict:
    """The ``transformers`` config of ``source`` (a folder or hub id) as a dict, read without running its code.

    A folder written by ``moh convert-hf`` / ``moh export-hf`` reads as its family's config with its ``moh_*`` head
    budget; one written by ``moh convert-llama`` as a LLaMA config. Only ``config.json`` is read (a hub id downloads
    that file alone), so the shapes are known before anything is built.
    """
    from transformers import AutoConfig, PretrainedConfig

    folder = Path(source).expanduser()
    if folder.is_dir():
        file = folder / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"init_from={source!r}: no config.json in the folder; give a transformers model "
                                    f"folder (written by save_pretrained, moh convert-hf or moh export-hf).")
        raw = PretrainedConfig._dict_from_json_file(file)  # as transformers reads it: Infinity, NaN decoded
    else:
        try:
            raw = AutoConfig.from_pretrained(source, trust_remote_code=False).to_dict()
        except (OSError, ValueError) as error:
            reason = str(error).strip().splitlines()[0]
            raise OSError(f"init_from={source!r}: cannot read its config ({reason}); give a local folder with "
                          f"config.json and weights, or a hub id reachable from here.") from None
    return family_config(raw, source).to_dict()


def default_budget(num_heads: int, shared: int | None = None) -> tuple[int, int]:
    """Paper section 4.4's split for a pretrained model: the first half of the heads shared (or ``shared``), half of
    the routed heads kept per token (75% active)."""
    shared = num_heads // 2 if shared is None else shared
    return shared, max(1, (num_heads - shared) // 2) if num_heads > shared else 0


def head_budget(moh: MoHConfig, config, heads: dict[int, int] | None = None) -> list[tuple[int, int]]:
    """(shared heads, routed heads kept) per attention layer that MoH gates in the family ``config`` under ``moh``,
    each for the layer's own heads (``query_heads``, or ``heads`` where the caller has them: each is a build of the
    model on the meta device): a per-layer list of ``moh`` has one entry per such layer.

    ``moh``'s budget when it sets one; else the budget a MoH source folder carries (``moh_*``); else
    ``default_budget``. Only the query-norm router fits a pretrained model through the attention interface.
    """
    if moh.router != "query_norm":
        raise ValueError(f"moh.router={moh.router!r}: continue-tuning a transformers model takes the parameter-free "
                         f"router (set moh.router: query_norm); transformers' attention interface passes the queries, "
                         f"not the layer input a learned router reads.")
    heads = query_heads(config) if heads is None else heads
    if moh.num_shared_heads != 0 or moh.top_k is not None:
        return [(layer["num_shared_heads"], layer["top_k"]) for layer in moh.layers(list(heads.values()), len(heads))]
    if getattr(config, "moh_num_shared_heads", None) is not None:
        return [remote_code().layer_budget(config, index) for index in heads]
    return [default_budget(layer) for layer in heads.values()]


def query_heads(config) -> dict[int, int]:
    """The query heads of each attention layer that MoH gates in the family ``config`` (``attention_layers``), by
    its ``layer_idx``: read from its model built on the meta device, so before any weight is read. A family without
    heads to gate stops in one line."""
    from transformers import AutoModelForCausalLM

    if not getattr(layer_config(config, 0), "num_attention_heads", None):
        raise ValueError(f"model_type={config.model_type!r}: this family has no attention heads "
                         f"(num_attention_heads) for MoH to gate; convert a model with multi-head attention.")
    family_class = _family_class(config)
    if not family_class._can_set_attn_implementation():  # a class property: refused before building
        raise ValueError(_bypasses_interface(family_class.__name__))
    with torch.device("meta"):  # from_config writes the attention implementation it picks into the config
        hf = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return {layer.layer_idx: layer_heads(layer, config) for layer in attention_layers(hf)}


def layer_heads(layer: nn.Module, config) -> int:
    """The query heads of one attention layer: the layer's own count where the family sets one per layer (Laguna's
    ``num_attention_heads_per_layer``, Inkling's sliding layers), else its config's ``num_attention_heads``."""
    return getattr(layer, "num_heads", None) or layer_config(config, layer.layer_idx).num_attention_heads


def layer_config(config, index: int):
    """The config of layer ``index``: ``config`` itself, or its layer's where fields vary by layer (a heterogeneous
    config, dots3's, refuses to read those fields from the whole model's)."""
    return config.per_layer_config[index] if getattr(config, "is_heterogeneous", False) else config


def attention_layers(hf: nn.Module) -> list[nn.Module]:
    """The attention layers of a ``transformers`` model that MoH gates, in layer order: the decoder layers' modules
    (``layer_idx``) that call the attention interface (``calls_interface``), at most one a layer index. A hybrid's
    other layers stay dense; a model none of whose attention goes through the interface, or with more than one
    attention a layer index (cross-attention), stops in one line naming it."""
    name = type(hf).__name__
    if not type(hf)._can_set_attn_implementation():
        raise ValueError(_bypasses_interface(name))
    layers = [m for m in hf.modules() if remote_code().is_attention_layer(m) and calls_interface(m)]
    depth = hf.config.num_hidden_layers
    if not layers:
        raise ValueError(f"{name}: none of its {depth} layers calls transformers' attention interface, where MoH "
                         f"gates the heads (its layers are state-space or linear attention, or attend by code of "
                         f"their own); convert a model with attention layers that do (Qwen2/3, Mistral, Phi-3, "
                         f"Gemma 2, LLaMA, ...).")
    indices = [layer.layer_idx for layer in layers]
    if len(set(indices)) != len(indices) or not all(isinstance(i, int) and 0 <= i < depth for i in indices):
        raise ValueError(f"{name}: its {len(layers)} attention modules calling the interface do not have one "
                         f"layer_idx each within num_hidden_layers={depth} (cross-attention, an encoder's, or "
                         f"recurrent modules numbered apart); MoH gates one self-attention a layer: not supported.")
    return layers


def calls_interface(module: nn.Module) -> bool:
    """Whether ``module``'s own ``forward`` calls transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``), read
    from its code, not its class's name: a hybrid's linear attention (``BailingHybridDeltaAttention``) is named an
    attention and has a ``layer_idx`` but computes its own recurrence, and Longcat's ``LongcatFlashMLA`` goes through
    the interface. ``checks.check_layers`` confirms it on a forward."""
    forward = inspect.unwrap(type(module).forward)  # under the family's decorators (deprecated keyword arguments)
    return "ALL_ATTENTION_FUNCTIONS" in getattr(getattr(forward, "__code__", None), "co_names", ())


def config_budget(hf: nn.Module) -> tuple[int | list, int | list]:
    """``moh_num_shared_heads`` and ``moh_top_k`` of the ``config.json`` of ``hf``, whose gated layers carry their
    routing module (``moh_heads``): one int for every layer, or a list by ``layer_idx`` with None for each layer that
    stays dense (a hybrid's layers that do not go through the interface)."""
    budget: list[tuple[int, int] | None] = [None] * hf.config.num_hidden_layers
    for layer in attention_layers(hf):
        budget[layer.layer_idx] = (layer.moh_heads.num_shared_heads, layer.moh_heads.router.top_k)
    if None not in budget and len(set(budget)) == 1:
        return budget[0]
    return [None if b is None else b[0] for b in budget], [None if b is None else b[1] for b in budget]


def _bypasses_interface(name: str) -> str:
    return (f"{name}: its attention does not go through transformers' attention interface, where MoH gates the heads; "
            f"convert a model whose family does (Qwen2/3, Mistral, Phi-3, Gemma 2, LLaMA, ...).")


def build_hf_causal(config: dict, moh: MoHConfig | None, weights: str | None = None,
                    dtype: torch.dtype | None = None) -> HFCausalLM:
    """``HFCausalLM`` of the family ``config`` (a ``read_source_config`` dict) with ``moh``'s head budget
    (``head_budget``; None: dense), with the weights of the folder or hub id ``weights`` or freshly initialised.

    ``dtype`` is the weights' dtype (default: torch's default dtype, which the precision plugin sets while Lightning
    builds the model).
    """
    from transformers import AutoModelForCausalLM

    family = family_config(config)
    implementation = None
    budget = None
    if moh is not None:
        budget = head_budget(moh, family)
        remote_code().register()
        family_class = _family_class(family)
        implementation = remote_code().moh_implementation(family_class, None)
        family.moh_router, family.moh_router_dtype = "query_norm", moh.router_dtype
    dtype = dtype or torch.get_default_dtype()
    try:
        if weights is None:
            hf = AutoModelForCausalLM.from_config(family, attn_implementation=implementation, dtype=dtype)
        else:
            hf = _from_pretrained(weights, family, implementation, dtype)
    except KeyError as error:  # GPT-Neo, Falcon, GIT: a table of attention classes keyed by implementation name
        if not str(error.args[0]).startswith("moh_"):
            raise
        raise ValueError(_bypasses_interface(_family_class(family).__name__)) from None
    if budget is not None:
        for layer, (shared, top_k) in zip(attention_layers(hf), budget, strict=True):
            heads = layer_heads(layer, family)
            # The layer's own widths: Gemma 4's head width differs between its sliding and its full-attention layers,
            # Inkling's sliding layers have heads and key / value heads of their own.
            head_dim = getattr(layer, "head_dim", None) or family.hidden_size // heads
            kv_heads = (getattr(layer, "num_key_value_heads", None)
                        or getattr(layer_config(family, layer.layer_idx), "num_key_value_heads", None) or heads)
            layer.moh_heads = InterfaceHeads(heads, kv_heads, head_dim, shared, top_k, moh.router_dtype,
                                             moh.execution)
            layer.moh_heads.family_only = layer.layer_idx in (getattr(family, "moh_family_attention", None) or ())
        hf.config.moh_num_shared_heads, hf.config.moh_top_k = config_budget(hf)
    return HFCausalLM(hf)


def _family_class(config) -> type:
    from transformers.models.auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"model_type={config.model_type!r}: transformers has no causal LM of this family.")
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def _from_pretrained(source: str, config, implementation: str | None, dtype: torch.dtype):
    """The family's model with the weights of ``source``, read by the family's own class (a MoH folder's remote code
    is this package's and never runs)."""
    family_class = _family_class(config)
    try:
        hf, info = family_class.from_pretrained(source, config=config, attn_implementation=implementation,
                                                dtype=dtype, output_loading_info=True)
        if info["missing_keys"]:
            # A composite's language model (language_model_config): its weights sit under a prefix of their own.
            hf, info = family_class.from_pretrained(source, config=config, attn_implementation=implementation,
                                                    dtype=dtype, output_loading_info=True, key_mapping=_COMPOSITE_KEYS)
            # save_pretrained would write the weights back under the composite's names, which the text family does
            # not read; without the record it saves as a model of the text family built here.
            del hf._weight_conversions
    except OSError as error:
        reason = str(error).strip().splitlines()[0]
        raise MissingDataError(f"init_from={source!r}: cannot load its weights ({reason}); give a local folder with "
                      f"config.json and weights, or a hub id reachable from here.") from None
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ValueError(f"init_from={source!r}: {len(missing)} weights of {family_class.__name__} are not in it "
                         f"({missing[0]}, ...); give a folder of this family's causal LM.")
    return hf


__all__ = ["HFCausalLM", "InterfaceHeads", "MOH_MODEL_TYPES", "attention_layers", "build_hf_causal", "calls_interface",
           "config_budget", "default_budget", "family_config", "head_budget", "layer_heads",
           "query_heads", "read_source_config"]

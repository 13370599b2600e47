"""MoH-LLaMA for ``transformers`` (``trust_remote_code``): the modelling file shipped in exported folders.

``convert.export_hf`` saves any MoH-LLaMA with this file beside its weights, so
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` and lm-eval's ``hf`` model load it without
this package. The weights keep LLaMA's names; each attention layer gates its heads before ``o_proj`` with one of the
suite's two routers:

* ``moh_router="learned"``: the two-stage router of ``moh_lightning.layers.routers.MoHRouter`` (paper Eq. 5-6 at the
  authors' scale), its linears under ``self_attn.router.{shared_router,routed_router,type_router}``;
* ``moh_router="query_norm"``: the parameter-free router of ``moh_lightning.layers.routers.QueryNormRouter`` (first
  ``moh_num_shared_heads`` heads always on, the ``moh_top_k`` routed heads with the largest query norm on), scoring
  in float32 or, with ``moh_router_dtype="activation"``, in the activations' dtype as the authors' MoH-LLaMA3 code.

``moh_num_shared_heads`` and ``moh_top_k`` are one int for every layer or a list with one entry per layer. The
exported model computes the gates only (inference and evaluation): the load-balance loss of training stays in the
suite. This file may import only torch, transformers and the query-norm gate's file ``query_norm.py``
(``moh_lightning.layers``'), which the export copies beside it; so it repeats the learned router's maths, and
``tests/tools/test_export_hf.py`` holds both to equal logits.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaAttention,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

try:  # an exported folder: the gate file the export copies beside this one
    from .query_norm import query_norm_gates
except ImportError:  # this file inside moh_lightning, where that file is the suite's own
    from moh_lightning.layers.query_norm import query_norm_gates


class MoHLlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus the head budget (shared heads and routed heads kept per token) and the router."""

    model_type = "moh_llama"

    def __init__(self, moh_num_shared_heads: int | list[int] = 0, moh_top_k: int | list[int] = 0,
                 moh_router: str = "query_norm", moh_two_stage_routing: bool = True,
                 moh_router_dtype: str = "float32", **kwargs) -> None:
        self.moh_num_shared_heads = moh_num_shared_heads
        self.moh_top_k = moh_top_k
        self.moh_router = moh_router
        self.moh_router_dtype = moh_router_dtype
        self.moh_two_stage_routing = moh_two_stage_routing
        super().__init__(**kwargs)

    def layer_budget(self, index: int) -> tuple[int, int]:
        """(shared heads, routed heads kept per token) of layer ``index``."""
        shared, top_k = self.moh_num_shared_heads, self.moh_top_k
        return (shared[index] if isinstance(shared, list) else shared,
                top_k[index] if isinstance(top_k, list) else top_k)


class MoHRouter(nn.Module):
    """The learned two-stage router: gates (B, T, h) of the attention input (B, T, C).

    Shared gates softmax(W_s x) * h_s, routed gates softmax(W_r x) kept on the top-k, renormalised over them and
    multiplied by k, the two groups weighted by 2 * softmax(W_h x). No linear is built where its softmax would be
    constant (one shared head) or where a group is empty, exactly as the suite's router.
    """

    def __init__(self, dim: int, num_heads: int, num_shared_heads: int, top_k: int, two_stage: bool = True) -> None:
        super().__init__()
        self.num_heads, self.num_shared_heads, self.top_k = num_heads, num_shared_heads, top_k
        num_routed = num_heads - num_shared_heads
        self.shared_router = nn.Linear(dim, num_shared_heads, bias=False) if num_shared_heads > 1 else None
        self.routed_router = nn.Linear(dim, num_routed, bias=False) if num_routed else None
        has_both = num_shared_heads > 0 and num_routed > 0
        self.type_router = nn.Linear(dim, 2, bias=False) if two_stage and has_both else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = []
        if self.num_shared_heads:
            shared = (self.shared_router(x).softmax(-1) * self.num_shared_heads if self.shared_router is not None
                      else x.new_ones(*x.shape[:-1], 1))
            groups.append(shared)
        if self.routed_router is not None:
            probs = self.routed_router(x).softmax(-1)                                  # (B, T, E)
            selected = torch.zeros_like(probs, dtype=torch.bool).scatter_(
                -1, probs.topk(self.top_k, dim=-1).indices, True)
            kept = probs * selected
            groups.append(kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).eps) * self.top_k)
        if self.type_router is not None:
            alpha = self.type_router(x).softmax(-1) * 2
            groups = [groups[0] * alpha[..., :1], groups[1] * alpha[..., 1:]]
        return torch.cat(groups, dim=-1)


class MoHLlamaAttention(LlamaAttention):
    """LLaMA attention whose head outputs are gated per token by the layer's MoH router."""

    def __init__(self, config: MoHLlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.num_shared_heads, self.top_k = config.layer_budget(layer_idx)
        self.router = None
        if config.moh_router == "learned":
            self.router = MoHRouter(config.hidden_size, config.num_attention_heads, self.num_shared_heads,
                                    self.top_k, config.moh_two_stage_routing)
        elif config.moh_router != "query_norm":
            raise ValueError(f"moh_router={config.moh_router!r}: this file knows 'learned' and 'query_norm'.")
        if config.moh_router_dtype not in ("float32", "activation"):
            raise ValueError(f"moh_router_dtype={config.moh_router_dtype!r}: choose 'float32' or 'activation'.")

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None,
                **kwargs):
        # transformers 5.24 renamed the layer's `past_key_values` to `cache`; an ignored cache decodes wrongly.
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.router is not None:
            gates = self.router(hidden_states)                                         # (B, T, h)
        else:
            gates = query_norm_gates(query_states, self.num_shared_heads, self.top_k, self.config.moh_router_dtype)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    eager_attention_forward)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
        )                                                                              # (B, T, h, d)
        attn_output = attn_output * gates[..., None].to(attn_output.dtype)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class MoHLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with MoH attention in every layer; LLaMA's weight names plus the learned routers'."""

    config_class = MoHLlamaConfig

    def __init__(self, config: MoHLlamaConfig) -> None:
        super().__init__(config)
        for index, layer in enumerate(self.model.layers):
            layer.self_attn = MoHLlamaAttention(config, index)
        self.post_init()

"""MoH-LLaMA for ``transformers`` (``trust_remote_code``): the modelling file shipped in exported folders.

``convert_llama.export_hf`` saves a continue-tuned MoH model (parameter-free query-norm router, paper
section 4.4) with this file beside its weights, so ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` and lm-eval's ``hf`` model load it without this package. It imports only torch and
transformers: the weights keep LLaMA's names, and each attention layer gates its heads before ``o_proj``
exactly as ``moh_lightning.layers.QueryNormRouter`` does (first ``moh_num_shared_heads`` heads always on,
the ``moh_top_k`` routed heads with the largest query norm on, the rest off).
"""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaAttention,
    apply_rotary_pos_emb,
    eager_attention_forward,
)


class MoHLlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus the head budget: shared heads and routed heads kept per token."""

    model_type = "moh_llama"

    def __init__(self, moh_num_shared_heads: int = 0, moh_top_k: int = 0, **kwargs) -> None:
        self.moh_num_shared_heads = moh_num_shared_heads
        self.moh_top_k = moh_top_k
        super().__init__(**kwargs)


def query_norm_gates(query: torch.Tensor, num_shared_heads: int, top_k: int) -> torch.Tensor:
    """{0, 1} gates (B, T, h) from the queries (B, h, T, d) before rotary embedding."""
    batch, heads, length, _ = query.shape
    gates = query.new_ones(batch, length, heads)
    if num_shared_heads == heads:
        return gates
    norms = query[:, num_shared_heads:].float().norm(dim=-1).transpose(1, 2)          # (B, T, E)
    probs = (norms / norms.std(-1, keepdim=True).clamp_min(1e-6)).softmax(-1)
    selected = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, probs.topk(top_k, dim=-1).indices, True)
    gates[..., num_shared_heads:] = selected.to(gates.dtype)
    return gates


class MoHLlamaAttention(LlamaAttention):
    """LLaMA attention whose head outputs are gated per token by the query-norm router."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        gates = query_norm_gates(query_states, self.config.moh_num_shared_heads, self.config.moh_top_k)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
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
    """``LlamaForCausalLM`` with MoH attention in every layer; same weight names as LLaMA."""

    config_class = MoHLlamaConfig

    def __init__(self, config: MoHLlamaConfig) -> None:
        super().__init__(config)
        for index, layer in enumerate(self.model.layers):
            layer.self_attn = MoHLlamaAttention(config, index)
        self.post_init()

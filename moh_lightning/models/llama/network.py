"""MoH-LLaMA: a LLaMA-style decoder whose attention is ``MoHAttention`` in causal mode (paper section 4.3).

RMSNorm, rotary position embedding (LLaMA / Hugging Face "rotate half" layout, so converted LLaMA weights
need no permutation), SwiGLU MLP, optional grouped-query attention and tied embeddings. The routing,
load-balance loss and KV cache are the shared attention block's; this file only arranges the decoder.
``config.fused_kernels`` swaps liger-kernel's kernels in for RMSNorm, SwiGLU, RoPE and the loss (``fused``) on CUDA,
with the same parameters under the same names.
The named models (Tab. A's LLM-S / LLM-B at 100 / 75 / 50% activated heads, the CPU default) are the shipped
configs in ``cli_configs/``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moh_lightning.layers import KVCache, MoHAttention
from moh_lightning.layers.moh_config import attention_layers
from moh_lightning.models.decoding import decode, sample
from moh_lightning.models.llama import fused as fused_ops
from moh_lightning.models.llama.config import LlamaConfig


class RotaryEmbedding(nn.Module):
    """cos / sin tables of rotary position embedding for positions ``start .. start + length - 1``."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + length, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)                                   # (T, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)                                         # (T, d)
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` (B, h, T, d) in the rotate-half layout of LLaMA's Hugging Face checkpoints."""
    # In the activations' dtype, as transformers' LLaMA: fp32 tables on bf16 activations would round differently
    # from the pretrained model.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm, or with ``fused`` liger-kernel's kernel of the same arithmetic."""

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        return fused_ops.rms_norm(x, self.weight, self.eps) if fused else super().forward(x)


class SwiGLU(nn.Module):
    """LLaMA's gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(fused_ops.silu_mul(gate, up) if fused else F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm decoder block: MoH self-attention then SwiGLU, each with a residual."""

    def __init__(self, config: LlamaConfig, moh: dict) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.attn = MoHAttention(config.embed_dim, config.num_heads, attn_head_dim=config.head_dim, qkv_bias=False,
                                 proj_bias=False, num_kv_heads=config.num_kv_heads, causal=True, **moh)
        self.mlp_norm = RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.mlp = SwiGLU(config.embed_dim, config.intermediate_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: KVCache | None = None, fused: bool = False) -> torch.Tensor:
        """``fused``: liger-kernel's kernels where this block runs eagerly (see ``fused``)."""
        cos, sin = rope
        fused = fused_ops.eager(fused)

        def rotate(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # One token (decoding) is rotated by torch: liger's kernel mistakes the rows of a one-token batch.
            if fused and q.shape[2] > 1:
                return fused_ops.rope(q, k, cos, sin)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        x = x + self.attn(self.attn_norm(x, fused), kv_cache=kv_cache, position_embedding=rotate)
        return x + self.mlp(self.mlp_norm(x, fused), fused)


class MoHLlama(nn.Module):
    """Causal decoder LM: token ids (B, T) to next-token logits (B, T, vocab), or to the loss against targets."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self._fused_kernels_ready = fused_ops.fused_kernels_ready(config.fused_kernels)
        self.embed = nn.Embedding(config.vocab_size, config.embed_dim)
        layers = attention_layers(config.moh, config.num_heads, config.depth)
        self.blocks = nn.ModuleList(Block(config, moh) for moh in layers)
        self.norm = RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryEmbedding(config.head_dim, config.rope_base)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Normal(0, 0.02) weights (routers included); residual output projections scaled by 1/sqrt(2 depth)
        as in GPT-2; unit RMSNorm gains."""
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scale = (2 * self.config.depth) ** -0.5 if name.endswith(("attn.proj", "down_proj")) else 1.0
                nn.init.normal_(module.weight, std=std * scale)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def block_size(self) -> int:
        """The longest sequence the model takes (the tools read it from every language model)."""
        return self.config.block_size

    def forward(self, idx: torch.Tensor, kv_caches: list[KVCache] | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``idx`` (B, T); with ``kv_caches`` the tokens continue the cached ones.

        With ``targets`` (B, T), the mean cross-entropy of the logits (in float32) against them instead: the fused
        path computes it without ever holding the (B, T, V) logits.
        """
        start = kv_caches[0].length if kv_caches is not None else 0
        length = idx.shape[1]
        if start + length > self.config.block_size:
            raise ValueError(f"sequence of {start + length} tokens exceeds block_size={self.config.block_size}: "
                             f"shorten the prompt / max_new_tokens or raise block_size.")
        rope = self.rope(start, length)
        fused = self.uses_fused_kernels(idx.device)
        x = self.embed(idx)                                                             # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, kv_caches[i] if kv_caches is not None else None, fused=fused)
        x = self.norm(x, fused_ops.eager(fused))
        if targets is not None and fused:
            return fused_ops.linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten())
        logits = self.lm_head(x)                                                        # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def uses_fused_kernels(self, device: torch.device) -> bool:
        """Whether a forward on ``device`` runs liger-kernel's kernels (``config.fused_kernels``)."""
        return self._fused_kernels_ready and (device.type == "cuda" or self.config.fused_kernels is True)

    def init_kv_caches(self, batch_size: int, max_len: int | None = None) -> list[KVCache]:
        """One empty ``KVCache`` per layer, on the model's device and dtype."""
        weight = self.lm_head.weight
        max_len = max_len or self.config.block_size
        return [KVCache(batch_size, self.config.num_kv_heads, max_len, self.config.head_dim,
                        device=weight.device, dtype=weight.dtype) for _ in self.blocks]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k_tokens: int | None = None, top_p: float = 1.0, eos_id: int | None = None,
                 seed: int | None = None) -> torch.Tensor:
        """Continues ``idx`` (B, T) by sampling, one token per forward through the KV cache.

        The router runs on every decoded token, so each new token picks its own heads. ``temperature=0``
        is greedy decoding; ``top_k_tokens`` and ``top_p`` filter as in ``sample``. Stops early once every row has
        produced ``eos_id``.
        """
        batch, length = idx.shape
        total = min(length + max_new_tokens, self.config.block_size)
        caches = self.init_kv_caches(batch, total)
        return decode(lambda tokens: self(tokens, caches)[:, -1], idx, total, temperature, top_k_tokens, top_p, eos_id,
                      seed)


__all__ = ["Block", "MoHLlama", "RMSNorm", "RotaryEmbedding", "SwiGLU", "apply_rope", "sample"]

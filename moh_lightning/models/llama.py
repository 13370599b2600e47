"""MoH-LLaMA: a LLaMA-style decoder whose attention is ``MoHAttention`` in causal mode (paper section 4.3).

RMSNorm, rotary position embedding (LLaMA / Hugging Face "rotate half" layout, so converted LLaMA weights
need no permutation), SwiGLU MLP, optional grouped-query attention and tied embeddings. The routing,
load-balance loss and KV cache are the shared attention block's; this file only arranges the decoder.
Named configs follow Tab. A (LLM-S / LLM-B at 100 / 75 / 50% activated heads) plus small CPU ones.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from moh_lightning.layers import ExecutionMode, KVCache, MoHAttention, check_head_budget


@dataclass
class LlamaConfig:
    """Architecture of a (MoH) LLaMA decoder.

    ``num_shared_heads`` heads are always on and ``top_k`` of the remaining routed heads are picked per
    token; ``dense=True`` is plain multi-head attention (the baseline). ``router="query_norm"`` is the
    parameter-free router used when continue-tuning a pretrained model (section 4.4).
    """

    vocab_size: int = 65536
    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    head_size: int | None = None
    n_kv_head: int | None = None
    intermediate_size: int = 2048
    block_size: int = 2048
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dense: bool = False
    num_shared_heads: int = 6
    top_k: int | None = 3
    router: Literal["learned", "query_norm"] = "learned"
    two_stage_routing: bool = True
    execution: ExecutionMode = "auto"

    def __post_init__(self) -> None:
        if self.head_size is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: set head_size.")
            self.head_size = self.n_embd // self.n_head
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}.")
        if self.head_size % 2:
            raise ValueError(f"head_size={self.head_size} must be even for rotary embeddings.")
        if not self.dense:
            self.top_k = check_head_budget(self.n_head, self.num_shared_heads, self.top_k, where="llm config")

    @property
    def activated_fraction(self) -> float:
        return 1.0 if self.dense else (self.num_shared_heads + self.top_k) / self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


# Tab. A shapes; vocab 65,536 as the paper states, which reproduces Tab. A's 186M / 881M parameters. The
# paper does not give the shared / routed split of its LLMs (Tab. 7 finds the ratio barely matters), so
# 75% shares half the heads and routes a quarter, 50% shares and routes a quarter each.
_LLM_S = {"n_layer": 12, "n_embd": 768, "n_head": 12, "head_size": 64, "intermediate_size": 2048}
_LLM_B = {"n_layer": 24, "n_embd": 1536, "n_head": 16, "head_size": 96, "intermediate_size": 4096}
# CPU default for the stdlib byte-level corpus: ~3M parameters, trains in minutes on 2 cores.
_STDLIB = {"vocab_size": 259, "n_layer": 4, "n_embd": 256, "n_head": 8, "head_size": 32,
           "intermediate_size": 688, "block_size": 256, "tie_embeddings": True}
_TINY = {"vocab_size": 259, "n_layer": 2, "n_embd": 64, "n_head": 4, "head_size": 16,
         "intermediate_size": 128, "block_size": 64}
LLAMA_CONFIGS: dict[str, dict] = {
    "llm_s_100": {**_LLM_S, "dense": True},
    "llm_s_75": {**_LLM_S, "num_shared_heads": 6, "top_k": 3},
    "llm_s_50": {**_LLM_S, "num_shared_heads": 3, "top_k": 3},
    "llm_b_100": {**_LLM_B, "dense": True},
    "llm_b_75": {**_LLM_B, "num_shared_heads": 8, "top_k": 4},
    "llm_b_50": {**_LLM_B, "num_shared_heads": 4, "top_k": 4},
    "llm_stdlib_100": {**_STDLIB, "dense": True},
    "llm_stdlib_75": {**_STDLIB, "num_shared_heads": 4, "top_k": 2},
    "llm_stdlib_50": {**_STDLIB, "num_shared_heads": 2, "top_k": 2},
    "tiny_100": {**_TINY, "dense": True},
    "tiny_75": {**_TINY, "num_shared_heads": 2, "top_k": 1},
    "tiny_50": {**_TINY, "num_shared_heads": 1, "top_k": 1},
}


def llama_config(name: str, **overrides) -> LlamaConfig:
    """A named config (``LLAMA_CONFIGS``) with keyword overrides."""
    if name not in LLAMA_CONFIGS:
        raise ValueError(f"Unknown LLM config {name!r}; choose one of {sorted(LLAMA_CONFIGS)}.")
    return LlamaConfig(**{**LLAMA_CONFIGS[name], **overrides})


class RotaryEmbedding(nn.Module):
    """cos / sin tables of rotary position embedding for positions ``start .. start + length - 1``."""

    def __init__(self, head_size: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + length, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)                                   # (T, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)                                         # (T, d)
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` (B, h, T, d) in the rotate-half layout of LLaMA's Hugging Face checkpoints."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class SwiGLU(nn.Module):
    """LLaMA's gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: MoH self-attention then SwiGLU, each with a residual."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = MoHAttention(
            config.n_embd, config.n_head, attn_head_dim=config.head_size, qkv_bias=False, proj_bias=False,
            num_shared_heads=config.num_shared_heads, top_k=config.top_k, dense=config.dense,
            two_stage_routing=config.two_stage_routing, router=config.router, num_kv_heads=config.n_kv_head,
            causal=True, execution=config.execution,
        )
        self.mlp_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = SwiGLU(config.n_embd, config.intermediate_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: KVCache | None = None) -> torch.Tensor:
        cos, sin = rope
        x = x + self.attn(self.attn_norm(x), kv_cache=kv_cache,
                          position_embedding=lambda q, k: (apply_rope(q, cos, sin), apply_rope(k, cos, sin)))
        return x + self.mlp(self.mlp_norm(x))


class MoHLlama(nn.Module):
    """Causal decoder LM: token ids (B, T) to next-token logits (B, T, vocab)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryEmbedding(config.head_size, config.rope_base)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Normal(0, 0.02) weights (routers included); residual output projections scaled by 1/sqrt(2 n_layer)
        as in GPT-2; unit RMSNorm gains."""
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scale = (2 * self.config.n_layer) ** -0.5 if name.endswith(("attn.proj", "down_proj")) else 1.0
                nn.init.normal_(module.weight, std=std * scale)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor, kv_caches: list[KVCache] | None = None) -> torch.Tensor:
        """Logits for ``idx`` (B, T); with ``kv_caches`` the tokens continue the cached ones."""
        start = kv_caches[0].length if kv_caches is not None else 0
        length = idx.shape[1]
        if start + length > self.config.block_size:
            raise ValueError(f"sequence of {start + length} tokens exceeds block_size={self.config.block_size}: "
                             f"shorten the prompt / max_new_tokens or raise block_size.")
        rope = self.rope(start, length)
        x = self.embed(idx)                                                             # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, kv_caches[i] if kv_caches is not None else None)
        return self.lm_head(self.norm(x))                                              # (B, T, V)

    def init_kv_caches(self, batch_size: int, max_len: int | None = None) -> list[KVCache]:
        """One empty ``KVCache`` per layer, on the model's device and dtype."""
        weight = self.lm_head.weight
        max_len = max_len or self.config.block_size
        return [KVCache(batch_size, self.config.n_kv_head, max_len, self.config.head_size,
                        device=weight.device, dtype=weight.dtype) for _ in self.blocks]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float = 1.0, eos_id: int | None = None, seed: int | None = None) -> torch.Tensor:
        """Continues ``idx`` (B, T) by sampling, one token per forward through the KV cache.

        The router runs on every decoded token, so each new token picks its own heads. ``temperature=0``
        is greedy decoding. Stops early once every row has produced ``eos_id``.
        """
        batch, length = idx.shape
        total = min(length + max_new_tokens, self.config.block_size)
        caches = self.init_kv_caches(batch, total)
        generator = torch.Generator(device=idx.device)
        if seed is not None:
            generator.manual_seed(seed)
        out, done = idx, torch.zeros(batch, dtype=torch.bool, device=idx.device)
        logits = self(idx, caches)[:, -1]
        for _ in range(total - length):
            token = sample(logits, temperature, top_k, top_p, generator)                 # (B, 1)
            if eos_id is not None:
                token = token.masked_fill(done[:, None], eos_id)
                done |= token[:, 0] == eos_id
            out = torch.cat([out, token], dim=1)
            if done.all() or out.shape[1] == total:
                break
            logits = self(token, caches)[:, -1]
        return out


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits`` (B, V): temperature, then top-k, then nucleus (top-p) filtering.

    Written out rather than borrowed from ``transformers``' logits warpers so the model file needs only
    torch; the semantics are the same (keep the smallest set of tokens whose probability reaches top_p).
    """
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep tokens until the mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)


__all__ = ["LLAMA_CONFIGS", "Block", "LlamaConfig", "MoHLlama", "RotaryEmbedding", "SwiGLU", "apply_rope",
           "llama_config", "sample"]

"""Decoding a causal language model token by token: the loop and the sampling that MoH-LLaMA and any ``transformers``
causal LM (``hf_causal``) share, so that both draw the same tokens from the same logits and seed."""
from __future__ import annotations

import torch


def decode(next_logits, idx: torch.Tensor, total: int, temperature: float, top_k_tokens: int | None, top_p: float,
           eos_id: int | None, seed: int | None) -> torch.Tensor:
    """Continues ``idx`` (B, T) to ``total`` tokens: ``next_logits(tokens)`` feeds the new tokens through the model's
    cache and returns the last position's logits (B, V); each step draws with ``sample``. Stops early once every row
    has produced ``eos_id`` (later tokens of a finished row are ``eos_id``)."""
    batch, length = idx.shape
    generator = torch.Generator(device=idx.device)
    if seed is not None:
        generator.manual_seed(seed)
    out, done = idx, torch.zeros(batch, dtype=torch.bool, device=idx.device)
    logits = next_logits(idx)
    for _ in range(total - length):
        token = sample(logits, temperature, top_k_tokens, top_p, generator)                     # (B, 1)
        if eos_id is not None:
            token = token.masked_fill(done[:, None], eos_id)
            done |= token[:, 0] == eos_id
        out = torch.cat([out, token], dim=1)
        if done.all() or out.shape[1] == total:
            break
        logits = next_logits(token)
    return out


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k_tokens: int | None = None, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits`` (B, V): temperature, then the ``top_k_tokens`` most likely tokens, then nucleus
    (top-p) filtering. (Named apart from MoH's ``top_k``, the routed heads per token.)

    Written out rather than borrowed from ``transformers``' logits warpers so the model file needs only
    torch; the semantics are the same (keep the smallest set of tokens whose probability reaches top_p).
    """
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k_tokens is not None and top_k_tokens < logits.shape[-1]:
        kth = logits.topk(top_k_tokens, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep tokens until the mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)


__all__ = ["decode", "sample"]

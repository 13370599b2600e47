"""Tiny random causal LMs of the families ``moh convert-hf`` supports, each saved like a hub checkpoint with a tokenizer
trained here (the ``tokenizers`` library): no download.

Each family keeps what sets it apart: Qwen2's q/k/v biases, Qwen3's query / key norms, Mistral's sliding window,
Phi-3's fused projections, Gemma 2's soft-capping, sliding window and query scale, LLaMA's grouped-query attention;
and settings that change the function (norm eps 1e-6, rotary theta, tied embeddings) that a conversion must keep.
"""
from __future__ import annotations

from pathlib import Path

import torch

TEXT = ("def parse(line):\n    return line.split(',')\n" "The quick brown fox jumps over the lazy dog. " * 3
        + "for i in range(10):\n    print(i * i)\n" "import os\nimport sys\n" "class Point:\n    x = 0\n")

_SHARED = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
#: family -> (config class name, keyword arguments on top of the shared tiny sizes)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral": ("MistralConfig", {"sliding_window": 6}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
}


def train_tokenizer(folder: Path):
    """A byte-level BPE of a few hundred tokens trained on ``TEXT``, saved to ``folder``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([TEXT], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_family(family: str, folder: Path, seed: int = 0) -> Path:
    """A tiny random ``family`` causal LM and the local tokenizer saved to ``folder``."""
    import transformers

    config_name, kwargs = FAMILIES[family]
    tokenizer = train_tokenizer(folder)
    # A few spare rows, as pretrained models have: transformers' family tokenizer classes may add a token of their own.
    config = getattr(transformers, config_name)(vocab_size=len(tokenizer) + 20, bos_token_id=tokenizer.bos_token_id,
                                                eos_token_id=tokenizer.eos_token_id, **{**_SHARED, **kwargs})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random non-zero biases and norm gains, so that dropping either would show
        for name, param in model.named_parameters():
            if name.endswith(("bias", "norm.weight", "layernorm.weight")):
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return folder


__all__ = ["FAMILIES", "TEXT", "save_family", "train_tokenizer"]

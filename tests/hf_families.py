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


#: Tiny sizes for any family's default config, by the field's name (transformers' names and their aliases); a field is
#: only ever shrunk.
_TINY = [
    (lambda key: "vocab_size" in key, 320),
    (lambda key: key in ("hidden_size", "n_embd", "d_model", "embed_dim", "n_embed", "dim", "emb_dim"), 64),
    (lambda key: key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers",
                         "decoder_layers"), 2),
    (lambda key: key in ("num_attention_heads", "n_head", "n_heads", "num_heads", "swa_num_attention_heads",
                         "encoder_attention_heads", "decoder_attention_heads", "index_n_heads"), 4),
    (lambda key: key in ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                         "swa_num_key_value_heads"), 2),
    (lambda key: key in ("head_dim", "v_head_dim", "qk_head_dim", "kv_channels", "attention_head_dim",
                         "global_head_dim", "swa_head_dim", "index_head_dim", "mamba_d_head"), 16),
    (lambda key: "intermediate_size" in key or key.endswith(("ffn_dim", "ffn_hidden_size")) or key in ("n_inner",
                                                                                                   "d_ff"), 96),
    (lambda key: key in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "n_experts",
                         "zero_expert_num"), 4),
    (lambda key: key in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k_experts", "moe_k"), 2),
    (lambda key: key in ("n_shared_experts", "num_shared_experts"), 1),
    (lambda key: key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_sequence_length"), 128),
    (lambda key: key == "kv_lora_rank", 16), (lambda key: key == "q_lora_rank", 24),
    (lambda key: key in ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim"), 8),
    (lambda key: key == "sliding_window", 6), (lambda key: key in ("n_group", "topk_group"), 1),
    # A sparse-attention indexer's keys per query (DeepSeek-V3.2's, HY-V4's): fewer than the tokens compared.
    (lambda key: key == "index_topk", 8),
    (lambda key: key == "hidden_size_per_layer_input", 16),  # Gemma 3n's per-layer inputs
    (lambda key: key == "num_kv_shared_layers", 0),  # Gemma 3n: later layers reuse earlier ones' keys and values
]
#: Mixture-of-experts sizes a default may leave None, which the family's code cannot run (DeepSeek-V2, dots1).
_EXPERTS = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts")
#: What the name rules cannot derive: fields that must agree with the new depth or widths, or defaults that do not
#: build (the family's checkpoints give them).
_TINY_EXTRA = {"gpt_neo": {"attention_types": [[["global", "local"], 1]]}, "xlnet": {"d_head": 16},
               "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [8, 16]},
               "mamba2": {"expand": 1}, "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
               "dory": {"n_input_layers": 1, "n_recurrent_layers": 0, "n_output_layers": 1},
               "dots3_note_text": {"head_dim": 16},  # its sliding layers' width: qk_nope_head_dim + qk_rope_head_dim
               # Mamba heads of width 16 filling the tiny width times Mamba's expansion (2).
               **dict.fromkeys(("bamba", "granitemoehybrid"), {"mamba_n_heads": 8, "mamba_d_head": 16}),
               # Its indexed-attention layers' token indexer, which the default leaves unset.
               "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                                  "indexer_budget": 8, "indexer_compress_ratio": 4},
               "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                              "rope_theta": 10000.0}}},
               # Layers with heads of their own number: Laguna's each, Inkling's sliding ones.
               "laguna": {"num_attention_heads_per_layer": [4, 8]}, "inkling_text": {"swa_num_attention_heads": 8}}


def _tiny_size(key: str, value: int) -> int:
    new = next((size for test, size in _TINY if test(key)), None)
    return new if new is not None and value > new else value


def _two_layers(layer_types: list[str]) -> list[str]:
    """Two layer types of a hybrid's list: its first, and another kind where it has one (full attention first),
    so that a tiny hybrid keeps an attention layer beside its linear / convolution / sliding ones."""
    others = [kind for kind in dict.fromkeys(layer_types) if kind != layer_types[0]]
    return [layer_types[0], next((kind for kind in others if "full" in kind), others[0] if others else layer_types[0])]


def _tiny_fields(config: dict) -> dict:
    """The fields of a default ``config`` dict to change for a tiny model, sub-configs (``text_config``) included."""
    layers, mla = config.get("num_hidden_layers"), "qk_rope_head_dim" in config
    # Multi-head attention stays so: latent attention (DeepSeek, GLM's) expands its keys to every query head.
    mha = config.get("num_key_value_heads") == config.get("num_attention_heads")
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = {**value, **_tiny_fields(value), **_TINY_EXTRA.get(value["model_type"], {})}
        elif key == "per_layer_config" and value:
            # One layer of the kind the source overrides (Gemma 4's full attention, dots3's sliding layers), keeping
            # its own head width and number apart from the others'.
            entry = next(iter(value.values()))
            out[key] = {"01": {**entry, **_tiny_fields(entry),
                               **{k: v for k, v in (("head_dim", 32), ("num_attention_heads", 8),
                                                    ("num_key_value_heads", 8)) if k in entry}}}
        elif key == "layer_types" and layers and value and len(value) == layers:
            out[key] = _two_layers(value)
        elif mla and key == "head_dim":  # multi-head latent attention's rotary width
            out[key] = 8
        elif key in ("head_dim", "num_key_value_heads") and value is None:
            out[key] = 16 if key == "head_dim" else 2
        elif key in _EXPERTS and value is None:
            out[key] = _tiny_size(key, 1000)
        elif key == "num_key_value_heads" and mha:
            out[key] = _tiny_size("num_attention_heads", value)
        elif isinstance(value, int) and not isinstance(value, bool) and key.endswith(("_token_id", "token_index")):
            if value >= 300:  # special tokens inside the tiny vocabulary
                out[key] = 0 if key.startswith("pad") else 300 + len(out) % 20
        elif isinstance(value, int) and not isinstance(value, bool):
            if _tiny_size(key, value) != value:
                out[key] = _tiny_size(key, value)
        elif isinstance(value, list) and layers and len(value) == layers:  # one entry a layer
            out[key] = [_tiny_size(key, v) if isinstance(v, int) and not isinstance(v, bool) else v
                        for v in value[:2]]
    return out


def tiny_config(model_type: str, **overrides):
    """A tiny version of transformers' default config of ``model_type``: 2 layers, width 64, 4 heads (2 key / value
    heads), a 320-token vocabulary, a few experts; per-layer lists cut to the new depth (a hybrid's layer types
    keeping an attention layer), derived ones rebuilt; ``overrides`` on top."""
    from transformers.models.auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class().to_dict()
    fields = {k: v for k, v in default.items() if k not in ("layer_types", "attention_layers")}
    return config_class.from_dict({**fields, **_tiny_fields(default), **_TINY_EXTRA.get(model_type, {}),
                                   **overrides})


def save_tiny(model_type: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random causal LM of any ``model_type`` transformers knows (``tiny_config`` with ``overrides``), saved to
    ``folder`` without a tokenizer, as a folder of weights alone."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()
    model.save_pretrained(folder)
    return folder


__all__ = ["FAMILIES", "TEXT", "save_family", "save_tiny", "tiny_config", "train_tokenizer"]

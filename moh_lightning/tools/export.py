"""``moh convert-llama`` and ``moh export-hf``: MoH-LLaMA folders that ``transformers`` and lm-eval load."""
from __future__ import annotations

import torch

from moh_lightning.data.text import load_tokenizer
from moh_lightning.models.convert_llama import export_hf, from_hf
from moh_lightning.tools.checkpoints import load_language_model


def convert_llama(source: str, out: str, num_shared_heads: int | None = None, top_k: int | None = None,
                  dtype: str = "bfloat16") -> str:
    """Converts a ``transformers`` LLaMA into a MoH-LLaMA folder that ``transformers`` and lm-eval load.

    Args:
        source: LLaMA checkpoint: a local folder or a hub id.
        out: Folder to write (weights, config, modelling code, tokenizer).
        num_shared_heads: Always-active heads per layer (the first ones); half of the heads when None.
        top_k: Routed heads kept per token; half of the routed heads (75% active) when None.
        dtype: Weight dtype of the written model (float32, bfloat16, float16).
    """
    from transformers import AutoTokenizer

    model = from_hf(source, num_shared_heads, top_k, dtype=getattr(torch, dtype))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        tokenizer = None  # a weights-only folder; pass the tokenizer to lm-eval separately
    export_hf(model, out, tokenizer)
    moh = model.config.moh
    print(f"wrote {out}: {moh.num_shared_heads} shared + top-{moh.top_k} of "
          f"{model.config.num_heads - moh.num_shared_heads} routed heads "
          f"({model.config.activated_fraction:.0%} active)")
    return out


def export_checkpoint(checkpoint: str, out: str, tokenizer: str | None = None) -> str:
    """Exports a ``moh fit`` LanguageModel checkpoint (query-norm router or dense) to a ``transformers`` folder.

    Args:
        checkpoint: A ``.ckpt`` written by ``moh fit`` with a LanguageModel.
        out: Folder to write.
        tokenizer: Tokenizer name or folder saved beside the weights; the training tokenizer when None.
    """
    task, data_hparams = load_language_model(checkpoint)
    name = tokenizer or data_hparams.get("tokenizer")
    export_hf(task.model, out, load_tokenizer(name) if name else None)
    print(f"wrote {out}")
    return out


__all__ = ["convert_llama", "export_checkpoint"]

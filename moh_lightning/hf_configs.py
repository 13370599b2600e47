"""A ``transformers`` causal LM's config from a ``config.json``, the folders this suite writes included.

Below the models and the data modules, since both read such configs: the ``hf_causal`` family to build a model, the
tokenizers to load a MoH folder's tokenizer under its family's config. Imports nothing of the suite.
"""
from __future__ import annotations

#: ``config.json`` ``model_type`` of the folders this suite writes: any family (``hf_causal``'s ``hf_moh``) and
#: MoH-LLaMA.
MOH_MODEL_TYPES = ("moh", "moh_llama")


def family_config(raw: dict, source: str = "config"):
    """The family's ``transformers`` config from a ``config.json`` dict, MoH folders included (their ``moh_*`` fields
    kept)."""
    from transformers.models.auto import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type == "moh":
        model_type = raw.get("moh_base_model_type")
        if model_type not in CONFIG_MAPPING:
            raise ValueError(f"{source}: moh_base_model_type={model_type!r} in config.json: give the model_type of a "
                             f"transformers causal LM family.")
    elif model_type == "moh_llama":
        model_type = "llama"
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{source}: model_type={model_type!r} is not a transformers model family; give a causal LM "
                         f"whose family transformers knows.")
    return language_model_config(CONFIG_MAPPING[model_type].from_dict({k: v for k, v in raw.items()
                                                                       if k not in ("model_type", "auto_map")}))


def language_model_config(config):
    """``config`` itself, or the text part of a composite (vision / audio + text) config such as Gemma 3's or Fuyu's:
    MoH converts the language model inside, read from the composite's weights."""
    from transformers.models.auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text = config.get_text_config(decoder=True)
    if text is config:
        return config
    if type(text) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"model_type={config.model_type!r}: its language model ({text.model_type!r}) has no "
                         f"transformers causal LM class to convert it into; convert a text-only model.")
    # Whether the output layer is the embedding is the composite's setting (MOSS's text part says no, its model yes).
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", text.tie_word_embeddings)
    return text


__all__ = ["MOH_MODEL_TYPES", "family_config", "language_model_config"]

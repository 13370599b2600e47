"""MoH-LLaMA: a LLaMA-style decoder with Mixture-of-Head attention (paper sections 4.3 and 4.4).

``config`` holds the decoder's sizes and head budget, ``network`` the decoder, ``convert`` the road to and from
``transformers`` LLaMA folders, ``hf_moh_llama`` the ``trust_remote_code`` modelling file copied into exported folders
(it imports nothing of this package), and ``authors`` the authors' MoH-LLaMA3-8B release.
"""
from moh_lightning.models.llama.authors import (
    AUTHORS_LLAMA_HUB,
    authors_budget,
    authors_llama_config,
    load_authors_llama,
    model_folder,
    read_weights,
)
from moh_lightning.models.llama.config import LlamaConfig
from moh_lightning.models.llama.convert import (
    ROUTER_LINEARS,
    export_hf,
    from_hf,
    hf_config_for,
    hf_to_moh_state_dict,
    layer_budgets,
    llm_config_from_hf,
    model_card,
    moh_to_hf_state_dict,
)
from moh_lightning.models.llama.network import (
    Block,
    MoHLlama,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rope,
    sample,
)

__all__ = ["AUTHORS_LLAMA_HUB", "ROUTER_LINEARS", "Block", "LlamaConfig", "MoHLlama", "RMSNorm", "RotaryEmbedding",
           "SwiGLU", "apply_rope", "authors_budget", "authors_llama_config", "export_hf", "from_hf", "hf_config_for",
           "hf_to_moh_state_dict", "layer_budgets", "llm_config_from_hf", "load_authors_llama",
           "model_card", "model_folder", "moh_to_hf_state_dict", "read_weights", "sample"]

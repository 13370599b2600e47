"""Any ``transformers`` causal LM whose attention goes through transformers' attention interface, as a MoH model.

``network`` builds the family's own model with the MoH attention implementation and the suite's routing in each
layer, ``checks`` proves each layer on a forward at conversion, ``export`` writes it as a folder that ``transformers``
loads, and ``hf_moh`` is the ``trust_remote_code`` file copied into those folders (it imports nothing of this
package).
"""
from moh_lightning.models.hf_causal.checks import check_layers, family_attention_layers
from moh_lightning.models.hf_causal.export import export_hf_causal, model_card
from moh_lightning.models.hf_causal.network import (
    MOH_MODEL_TYPES,
    HFCausalLM,
    InterfaceHeads,
    attention_layers,
    build_hf_causal,
    config_budget,
    default_budget,
    family_config,
    head_budget,
    layer_heads,
    query_heads,
    read_source_config,
)

__all__ = ["MOH_MODEL_TYPES", "HFCausalLM", "InterfaceHeads", "attention_layers", "build_hf_causal",
           "check_layers", "config_budget", "default_budget", "export_hf_causal", "family_attention_layers",
           "family_config", "head_budget", "layer_heads", "model_card", "query_heads", "read_source_config"]

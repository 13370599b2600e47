"""TransNeXt (Shi, CVPR 2024) with Mixture-of-Head attention: the paper's MoH-ViT (section 4.1, Tab. 1).

``config`` holds the architecture and head budget, ``attention`` TransNeXt's two token mixers as ``MoHAttention``
layers, ``network`` the four-stage classifier and backbone, ``weights`` the checkpoint layouts (the authors' included),
``registry`` the named models for ``timm.create_model`` (importing this package registers them) and ``authors`` the
released checkpoints matched to them. The models are not TorchScript: their attention is ``MoHAttention``'s.
"""
from moh_lightning.models.transnext.attention import (
    AggregatedAttention,
    ContinuousPositionBias,
    TransNeXtAttention,
    relative_position_table,
)
from moh_lightning.models.transnext.authors import AUTHORS_VIT, EXPERIMENT_CONFIGS, authors_vit
from moh_lightning.models.transnext.config import NUM_STAGES, TransNeXtConfig
from moh_lightning.models.transnext.network import (
    ConvolutionalGLU,
    OverlapPatchEmbed,
    TransNeXt,
    TransNeXtBlock,
    TransNeXtStage,
    create_transnext,
)
from moh_lightning.models.transnext.registry import (
    AUTHORS_HUB_IDS,
    GENERIC_TRANSNEXT,
    NAMED_MODELS,
    config_arguments,
    transnext_config,
)
from moh_lightning.models.transnext.weights import (
    checkpoint_state_dict,
    from_authors_state_dict,
    is_authors_layout,
    load_pretrained,
)

__all__ = [
    "AUTHORS_HUB_IDS", "AUTHORS_VIT", "EXPERIMENT_CONFIGS", "GENERIC_TRANSNEXT", "AggregatedAttention",
    "ContinuousPositionBias",
    "ConvolutionalGLU", "NAMED_MODELS", "NUM_STAGES", "OverlapPatchEmbed", "TransNeXt", "TransNeXtAttention",
    "TransNeXtBlock", "TransNeXtConfig", "TransNeXtStage", "authors_vit", "checkpoint_state_dict", "config_arguments",
    "create_transnext", "from_authors_state_dict", "is_authors_layout", "load_pretrained", "relative_position_table",
    "transnext_config",
]

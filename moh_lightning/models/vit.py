"""MoH Vision Transformer: timm's ``VisionTransformer`` with ``MoHAttention`` entering through ``attn_layer``.

Nothing of ViT is re-implemented here: the config says which heads each layer shares and routes, and timm
builds the model. The named models (the paper's budgets on ViT-S/B) are the shipped configs in ``cli_configs/``, and
are registered with timm on ``import moh_lightning`` (``timm.create_model("moh_vit_small_patch16_224_75")``) with
timm's ViT interface: ``features_only``, ``forward_intermediates``, FX feature extraction and ``torch.export``. Unlike
timm's own ViTs they are not TorchScript: ``MoHAttention`` is not (its router's gates come out of a custom autograd
function, and its forward takes a callable and a KV cache object).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, register_model
from timm.models._registry import generate_default_cfgs
from timm.models.vision_transformer import VisionTransformer

from moh_lightning.layers import MoHAttention, layerwise
from moh_lightning.layers.moh_config import MoHConfig, activated_fraction, as_moh_config, attention_layers
from moh_lightning.serialization import checkpoint_type, read_weights_file


@checkpoint_type
@dataclass
class ViTConfig:
    """Architecture of a (MoH) ViT: timm's ``VisionTransformer`` arguments and the MoH head budget.

    Defaults are ViT-S/16 at 224 pixels for ImageNet-1k. ``head_dim`` is the width of one head
    (``embed_dim // num_heads`` when None). ``pretrained`` starts the MoH-ViT from dense timm ViT weights: a timm
    model name (downloaded through timm, e.g. ``vit_small_patch16_224.augreg_in21k_ft_in1k``) or a local file
    (``.safetensors`` or a ``torch.save``'d state dict, timm's names). Every weight but the routers (fresh) must
    fit; the classifier head is left fresh when ``num_classes`` differs, the position embedding is resampled to
    another grid and the patch embedding adapted to ``in_chans`` as timm does.
    """

    img_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 384
    depth: int = 12
    num_heads: int = 6
    head_dim: int | None = None
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    qk_norm: bool = False
    drop_rate: float = 0.0
    drop_path_rate: float = 0.1
    global_pool: str = "token"
    moh: MoHConfig | None = field(default_factory=lambda: MoHConfig(num_shared_heads=2, top_k=2))
    timm_kwargs: dict = field(default_factory=dict)
    pretrained: str | None = None

    def __post_init__(self) -> None:
        self.moh = as_moh_config(self.moh)
        attention_layers(self.moh, self.num_heads, self.depth)

    @property
    def activated_fraction(self) -> float:
        return activated_fraction(self.moh, self.num_heads, self.depth)


def create_vit(config: ViTConfig) -> VisionTransformer:
    """Builds timm's ``VisionTransformer`` with a MoH (or dense) attention layer in every block."""
    layers = attention_layers(config.moh, config.num_heads, config.depth)
    common = {key: value for key, value in layers[0].items() if key not in ("num_shared_heads", "top_k")}
    if config.head_dim is not None:
        common["attn_head_dim"] = config.head_dim
    attn_layer = layerwise([layer.get("num_shared_heads", 0) for layer in layers],
                           [layer.get("top_k", 0) for layer in layers], **common)
    model = VisionTransformer(
        img_size=config.img_size, patch_size=config.patch_size, in_chans=config.in_chans,
        num_classes=config.num_classes, embed_dim=config.embed_dim, depth=config.depth,
        num_heads=config.num_heads, mlp_ratio=config.mlp_ratio, qkv_bias=config.qkv_bias,
        qk_norm=config.qk_norm, drop_rate=config.drop_rate, drop_path_rate=config.drop_path_rate,
        global_pool=config.global_pool, attn_layer=attn_layer, **config.timm_kwargs,
    )
    assert all(isinstance(block.attn, MoHAttention) for block in model.blocks)
    if config.pretrained:
        load_dense_timm_weights(model, config.pretrained)
    return model


def _dense_state_dict(source: str) -> dict:
    """The state dict of a local weights file, or of the timm model ``source`` downloaded with its weights."""
    path = Path(source).expanduser()
    if path.is_file():
        state = read_weights_file(path)
        for key in ("state_dict", "model", "state_dict_ema"):
            if isinstance(state.get(key), dict):
                state = state[key]
                break
        return state
    if source.startswith(("/", "./", "../", "~")) or path.suffix in (".pth", ".pt", ".bin", ".safetensors", ".ckpt"):
        raise FileNotFoundError(f"arch.pretrained={source!r}: no such file; give a timm model name or a local "
                                f"weights file (.safetensors or a torch.save'd state dict).")
    import timm

    try:
        return timm.create_model(source, pretrained=True).state_dict()
    except RuntimeError as error:  # an unknown name
        raise ValueError(f"arch.pretrained={source!r}: {str(error).splitlines()[0]}; give a timm model name "
                         f"(timm.list_pretrained('vit_*')) or a local weights file.") from None
    except OSError as error:  # offline, or the hub unreachable
        raise OSError(f"arch.pretrained={source!r}: cannot download it ({str(error).strip().splitlines()[0]}); "
                      f"pass a local file instead: the model.safetensors of its hub folder "
                      f"(hf download timm/{source.split('.')[0]}... on a machine online) or "
                      f"torch.save(timm.create_model({source!r}, pretrained=True).state_dict(), 'vit.pth').") from None


def load_dense_timm_weights(model: VisionTransformer, source: str) -> VisionTransformer:
    """Dense timm ViT weights into a MoH-ViT: the attention's qkv / proj load as they are, the routers stay fresh.

    timm's own ``checkpoint_filter_fn`` resamples the position embedding to the model's grid and adapts the patch
    embedding; a classifier head of another size is left fresh. Any other weight that does not fit stops in one line.
    """
    from timm.models.vision_transformer import checkpoint_filter_fn

    state = checkpoint_filter_fn(_dense_state_dict(source), model)
    own = model.state_dict()
    fresh_head = [k for k in ("head.weight", "head.bias") if k in state and k in own and state[k].shape != own[k].shape]
    for key in fresh_head:
        del state[key]
    in_chans, patch = model.patch_embed.proj.in_channels, state.get("patch_embed.proj.weight")
    if patch is not None and patch.shape[1] != in_chans:
        from timm.models._manipulate import adapt_input_conv

        state["patch_embed.proj.weight"] = adapt_input_conv(in_chans, patch)
    wrong = [k for k in state if k in own and state[k].shape != own[k].shape]
    if wrong:
        raise ValueError(f"arch.pretrained={source!r}: {len(wrong)} weights do not fit this ViTConfig (e.g. {wrong[0]} "
                         f"{tuple(state[wrong[0]].shape)} vs {tuple(own[wrong[0]].shape)}); match embed_dim, depth, "
                         f"num_heads, patch_size and mlp_ratio to the dense model.")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if ".router." not in k and k not in fresh_head]
    if missing or unexpected:
        raise ValueError(f"arch.pretrained={source!r}: {len(missing)} weights missing (e.g. {missing[:1]}), "
                         f"{len(unexpected)} unexpected (e.g. {unexpected[:1]}); it is not a timm ViT of this shape.")
    return model


# Named MoH-ViTs, registered with timm: the budgets of the shipped vit_{s,b}_* configs. Each name maps to the ViTConfig
# fields that differ from its defaults (ViT-S/16 at 224).
NAMED_VITS: dict[str, dict] = {
    "moh_vit_small_patch16_224_80": {"moh": {"num_shared_heads": 2, "top_k": [3] * 10 + [2] * 2}},
    "moh_vit_small_patch16_224_75": {"moh": {"num_shared_heads": 2, "top_k": [3] * 6 + [2] * 6}},
    "moh_vit_base_patch16_224_75": {"embed_dim": 768, "num_heads": 12, "moh": {"num_shared_heads": 4, "top_k": 5}},
    "moh_vit_base_patch16_224_50": {"embed_dim": 768, "num_heads": 12, "moh": {"num_shared_heads": 2, "top_k": 4}},
}


def named_vit_config(name: str, **overrides: Any) -> ViTConfig:
    """The config of a named MoH-ViT, with ``overrides`` (e.g. ``num_classes``) on top."""
    if name not in NAMED_VITS:
        raise ValueError(f"unknown MoH-ViT {name!r}: choose one of {', '.join(NAMED_VITS)}.")
    return ViTConfig(**{**NAMED_VITS[name], **overrides})


default_cfgs = generate_default_cfgs({name: {
    "num_classes": 1000, "input_size": (3, 224, 224), "crop_pct": 0.875, "interpolation": "bicubic",
    "fixed_input_size": True, "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
    "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0", "paper_ids": "arXiv:2410.11842",
} for name in NAMED_VITS})


def _create(name: str, pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    def build(**fields: Any) -> VisionTransformer:
        return create_vit(named_vit_config(name, **fields))

    # As timm's own ViTs: features_only reads blocks through forward_intermediates, by default the last three.
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(build, name, pretrained,
                                feature_cfg={"out_indices": out_indices, "feature_cls": "getter"}, **kwargs)


@register_model
def moh_vit_small_patch16_224_80(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MoH-ViT-S/16, 80.6% heads: 2 shared + top-3 of 4 in layers 0-9, top-2 in 10-11 (vit_s_80.yaml)."""
    return _create("moh_vit_small_patch16_224_80", pretrained, **kwargs)


@register_model
def moh_vit_small_patch16_224_75(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MoH-ViT-S/16, 75% heads: 2 shared + top-3 of 4 in layers 0-5, top-2 in 6-11 (vit_s_75.yaml)."""
    return _create("moh_vit_small_patch16_224_75", pretrained, **kwargs)


@register_model
def moh_vit_base_patch16_224_75(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MoH-ViT-B/16, 75% heads: 4 shared + top-5 of 8 in every layer (vit_b_75.yaml)."""
    return _create("moh_vit_base_patch16_224_75", pretrained, **kwargs)


@register_model
def moh_vit_base_patch16_224_50(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MoH-ViT-B/16, 50% heads: 2 shared + top-4 of 10 in every layer (vit_b_50.yaml)."""
    return _create("moh_vit_base_patch16_224_50", pretrained, **kwargs)


__all__ = ["NAMED_VITS", "ViTConfig", "create_vit", "named_vit_config"]

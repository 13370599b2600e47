"""Dense timm ViT weights into a MoH-ViT: the one checkpoint layout a MoH-ViT starts from.

Apart from the network because reading someone's weights (a file or a timm download, resampled and adapted by timm's
own filter) is its own concern, which the network does not need to be built.
"""
from __future__ import annotations

from pathlib import Path

from timm.models import adapt_input_conv
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from moh_lightning.serialization import read_weights_file


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
    state = checkpoint_filter_fn(_dense_state_dict(source), model)
    own = model.state_dict()
    fresh_head = [k for k in ("head.weight", "head.bias") if k in state and k in own and state[k].shape != own[k].shape]
    for key in fresh_head:
        del state[key]
    in_chans, patch = model.patch_embed.proj.in_channels, state.get("patch_embed.proj.weight")
    if patch is not None and patch.shape[1] != in_chans:
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


__all__ = ["load_dense_timm_weights"]

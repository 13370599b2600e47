"""Weights into a MoH-ViT: dense timm ViTs, timm exports and the suite's own ``moh fit`` checkpoints, any head budget.

Apart from the network because reading someone's weights (a file or a timm download, resampled and adapted by timm's
own filter) is its own concern, which the network does not need to be built.
"""
from __future__ import annotations

from pathlib import Path

from timm.models import adapt_input_conv
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from moh_lightning.errors import BadValueError, MissingDataError
from moh_lightning.serialization import read_weights_file
from moh_lightning.weights import check_fit, unwrap

# Where a weights file keeps the network: a `moh fit` checkpoint's or a timm training checkpoint's weights before
# their EMA copy, as timm's own loader reads them.
_WRAPPERS = ("state_dict", "model", "state_dict_ema")


def _state_dict(source: str, key: str) -> dict:
    """The state dict of a local weights file (``moh fit``'s ``model.`` prefix removed), or of the timm model
    ``source`` downloaded with its weights."""
    path = Path(source).expanduser()
    if path.is_dir():  # an `moh export-timm` folder, or a timm hub folder downloaded
        if not (path / "model.safetensors").is_file():
            raise MissingDataError(f"{key}={source!r}: no model.safetensors in this folder; give an `moh "
                                   f"export-timm` folder, a weights file or a .ckpt written by `moh fit`.")
        path = path / "model.safetensors"
    if path.is_file():
        return unwrap(read_weights_file(path), _WRAPPERS)
    if (source.startswith(("/", "./", "../", "~")) or path.suffix in (".pth", ".pt", ".bin", ".safetensors", ".ckpt")
            or ("/" in source and path.parent.is_dir())):  # a path into a folder that exists
        raise MissingDataError(f"{key}={source!r}: no such file; give a timm model name, a local weights file "
                               f"(.safetensors or a torch.save'd state dict), an `moh export-timm` folder or a .ckpt "
                               f"written by `moh fit`.")
    import timm

    try:
        return timm.create_model(source, pretrained=True).state_dict()
    except (RuntimeError, ValueError) as error:  # an unknown name, or one timm cannot parse
        raise BadValueError(f"{key}={source!r}: {str(error).splitlines()[0]}; give a timm model name "
                            f"(timm.list_pretrained('vit_*')) or a local weights file.") from None
    except OSError as error:  # offline, or the hub unreachable
        raise MissingDataError(
            f"{key}={source!r}: cannot download it ({str(error).strip().splitlines()[0]}); pass a local file "
            f"instead: the model.safetensors of its hub folder (hf download timm/{source.split('.')[0]}... on a "
            f"machine online) or torch.save(timm.create_model({source!r}, pretrained=True).state_dict(), "
            f"'vit.pth').") from None


def _routers(state: dict, layer: str) -> dict:
    """The shapes of one layer's router tensors in ``state`` (``layer`` is the attention's name, ``blocks.3.attn``)."""
    return {name: tuple(value.shape) for name, value in state.items() if name.startswith(f"{layer}.router.")}


def load_vit_weights(model: VisionTransformer, source: str, key: str = "model.init_args.init_from") -> str:
    """Weights into a (MoH-)ViT, and what was loaded, in words: a timm model name or weights file (a dense ViT, an
    ``moh export-timm`` folder's file) or a ``moh fit`` checkpoint of an ``ImageClassifier``; ``key`` names the option.

    The attention's qkv / proj and every other weight load as they are. A layer's router loads when the source has one
    of the same shapes (the same split into shared and routed heads), and is left fresh otherwise (a dense source,
    another head budget); routers this model has no place for are left out. timm's own ``checkpoint_filter_fn``
    resamples the position embedding to the model's grid and the patch embedding to its patch size, the patch
    embedding is adapted to ``in_chans`` as timm does, and a classifier head of another size is left fresh. Any other
    weight that does not fit stops in one line.
    """
    state = checkpoint_filter_fn(_state_dict(source, key), model)
    own = model.state_dict()
    in_chans, patch = model.patch_embed.proj.in_channels, state.get("patch_embed.proj.weight")
    if patch is not None and patch.shape[1] != in_chans:
        state["patch_embed.proj.weight"] = adapt_input_conv(in_chans, patch)
    left_out = []
    head = [k for k in ("head.weight", "head.bias") if k in state and k in own and state[k].shape != own[k].shape]
    if head:
        left_out.append(f"the head ({state['head.weight'].shape[0]} classes there, {own['head.weight'].shape[0]} "
                        f"here)")
    layers = sorted({name.partition(".router.")[0] for name in [*own, *state] if ".router." in name})
    kept = [layer for layer in layers if _routers(own, layer) and _routers(own, layer) == _routers(state, layer)]
    fresh = [layer for layer in layers if _routers(own, layer) and layer not in kept]
    dropped = [name for layer in layers if layer not in kept for name in _routers(state, layer)]
    if dropped:
        left_out.append(f"{len(dropped)} router tensors" + ("" if kept or fresh else " (this network is dense)"))
    for name in head + dropped:
        del state[name]
    check_fit(model, state, f"{key}={source!r}", "match embed_dim, depth, num_heads, patch_size and mlp_ratio to the "
              "weights' model.", fresh=lambda name: ".router." in name or name in head)
    model.load_state_dict(state, strict=False)
    if kept and fresh:
        routers = f", routers kept in {len(kept)} layers and fresh in {len(fresh)} (another head budget)"
    elif fresh:
        routers = f", routers fresh ({'another head budget' if dropped else 'the weights have none'})"
    else:
        routers = ", routers kept" if kept else ""
    return f"{len(state)} tensors loaded{routers}" + (f"; left out: {', '.join(left_out)}" if left_out else "")


__all__ = ["load_vit_weights"]

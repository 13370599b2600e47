"""``moh export-timm``: an image classifier trained here (MoH-ViT or MoH-TransNeXt) as a timm hub folder.

The folder is what ``timm.models.push_to_hf_hub`` uploads: ``config.json`` (the architecture, the arguments that
rebuild this network from it, and the preprocessing), ``model.safetensors`` and a model card. Any timm
user loads it once the suite's models are registered (importing ``moh_lightning.models.transnext`` or
``moh_lightning.models.vit`` registers them)::

    import timm, moh_lightning.models.transnext
    model = timm.create_model("local-dir:folder", pretrained=True)        # or "hf-hub:owner/name" once pushed
    model = timm.create_model("moh_transnext_small_75", pretrained=True,   # the weights file alone
                              pretrained_cfg_overlay=dict(file="folder/model.safetensors", num_classes=1000))

(with the file alone, pass ``config.json``'s ``model_args`` as keyword arguments when they are not the named model's,
and its ``num_classes`` in the overlay: timm re-initialises a head whose size differs from the overlay's).

``--push_to owner/name`` uploads the folder through ``huggingface_hub``.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from moh_lightning.data.image_transforms import IMAGENET_MEAN, IMAGENET_STD, MNIST_MEAN, MNIST_STD, normalisation
from moh_lightning.models.transnext import GENERIC_TRANSNEXT, NAMED_MODELS, TransNeXtConfig
from moh_lightning.models.vit import GENERIC_VIT, NAMED_VITS, ViTConfig
from moh_lightning.outputs import check_output_folder, created_folder

# Each family: its config class, its table of registered names and the name of any other shape.
FAMILIES = {"transnext": (TransNeXtConfig, NAMED_MODELS, GENERIC_TRANSNEXT),
            "vit": (ViTConfig, NAMED_VITS, GENERIC_VIT)}
# Fields a named model keeps its name under, as timm's: a new classifier head, the training-only regularisation,
# and the loading of starting weights.
_NOT_IDENTITY = {"num_classes", "drop_rate", "drop_path_rate", "pretrained"}


def export_timm(checkpoint: str, out: str, push_to: str | None = None, private: bool = False,
                token: str | None = None, overwrite: bool = False) -> Path:
    """Writes a ``moh fit`` image-classifier checkpoint as a timm folder and optionally pushes it to the hub.

    Args:
        checkpoint: A ``.ckpt`` of ``ImageClassifier`` (MoH-ViT) or ``TransNeXtClassifier`` (MoH-TransNeXt).
        out: The folder to write (created); refused when it holds anything already, unless ``overwrite``.
        push_to: A hub repo id (``owner/name``) to upload the folder to (created if missing).
        private: Create the hub repo private.
        token: Hugging Face token; the cached login when None.
        overwrite: Write into an ``out`` that holds files already, replacing those of the same names.
    """
    folder = check_output_folder(out, "--out", overwrite)
    import timm

    from moh_lightning.tasks.checkpoints import read_checkpoint
    from moh_lightning.tasks.classification import ImageClassifier, TransNeXtClassifier

    raw = read_checkpoint(checkpoint, (ImageClassifier, TransNeXtClassifier), "export-timm")
    family, arch = _classifier(raw, checkpoint)
    name, model_args = registered_name(arch)
    model = timm.create_model(name, **model_args)
    state = {key.removeprefix("model."): value for key, value in raw["state_dict"].items() if key.startswith("model.")}
    model.load_state_dict(state)

    data = dict(raw.get("datamodule_hyper_parameters") or {})
    # The class folders' names travel with the checkpoint; timm keeps them as the pretrained config's label_names.
    class_names = (raw.get("hyper_parameters") or {}).get("class_names")
    model_config = {"label_names": list(class_names)} if class_names else None
    with created_folder(folder):
        timm.models.save_for_hf(model.eval(), folder, model_config=model_config, model_args=model_args,
                                safe_serialization=True, data_config=_preprocessing(data, arch))
        (folder / "README.md").write_text(model_card(name, arch, family, checkpoint, model))
    print(f"wrote {folder}: {name} ({describe(arch)}); load it with `import {_module(family)}` then "
          f"timm.create_model('local-dir:{folder}', pretrained=True)")
    if push_to:
        print(f"pushed {folder} to {push_folder(folder, push_to, private=private, token=token)}")
    return folder


def registered_name(arch: TransNeXtConfig | ViTConfig) -> tuple[str, dict]:
    """The name ``arch`` exports under and the (JSON) arguments that rebuild it from that name: a registered model's
    name when ``arch`` is that model (up to its head size and regularisation), else the family's name for any shape
    (``moh_vit``, ``moh_transnext``) with every field that differs from the family's defaults."""
    config_class, named, generic = FAMILIES["transnext" if isinstance(arch, TransNeXtConfig) else "vit"]
    ours = _json(asdict(arch))

    def differences(name: str) -> dict:
        base = _json(asdict(config_class(**named[name].fields)))
        return {key: value for key, value in ours.items() if value != base[key]}

    for name in named:
        if name != generic and not set(differences(name)) - _NOT_IDENTITY:
            return name, differences(name)
    return generic, differences(generic)


def describe(arch: TransNeXtConfig | ViTConfig) -> str:
    """The network in words: its kind, sizes and head budget."""
    if isinstance(arch, ViTConfig):
        shape = (f"ViT, {arch.depth} layers of width {arch.embed_dim}, {arch.num_heads} heads, patch {arch.patch_size} "
                 f"at {arch.img_size}")
    else:
        shape = f"TransNeXt, depths {list(arch.depth)}, widths {list(arch.embed_dim)}, heads {list(arch.num_heads)}"
    heads = "dense" if arch.moh is None else f"MoH, {arch.activated_fraction:.1%} of heads active"
    return f"{shape}, {heads}, {arch.num_classes} classes"


def model_card(name: str, arch: TransNeXtConfig | ViTConfig, family: str, checkpoint: str, model) -> str:
    """A hub model card: what the network is, its head budget, where it came from and how to load it."""
    moh = arch.moh
    module = _module(family)
    if moh is None:
        budget = "dense multi-head attention (every head of every layer)"
    else:
        unit = "per stage" if family == "transnext" else "per layer"
        budget = (f"{moh.num_shared_heads} shared heads and the top-{moh.top_k} routed heads ({unit}; "
                  f"router `{moh.router}`, two-stage routing {moh.two_stage_routing}): "
                  f"{arch.activated_fraction:.1%} of the heads active per token")
    params = sum(p.numel() for p in model.parameters())
    return f"""---
tags:
- image-classification
- timm
- mixture-of-head-attention
library_name: timm
license: apache-2.0
---
# {Path(checkpoint).stem}: {name} (Mixture-of-Head attention)

A {"TransNeXt (Shi, CVPR 2024)" if family == "transnext" else "timm ViT"} classifier with Mixture-of-Head attention
(MoH, Jin et al., ICML 2025, arXiv 2410.11842), trained with moh_lightning.

* Architecture: `{name}` with the arguments in `config.json` (`model_args`): {describe(arch)};
  {params / 1e6:.2f}M parameters, {arch.in_chans}-channel {arch.img_size}x{arch.img_size} input.
* Heads: {budget}.
* Source: `{checkpoint}` (a `moh fit` checkpoint), exported with `moh export-timm`.

```python
import timm
import {module}  # registers the MoH models with timm

model = timm.create_model("hf-hub:<this repo>", pretrained=True).eval()
```
"""


def push_folder(folder: Path, repo_id: str, private: bool = False, token: str | None = None) -> str:
    """Uploads ``folder`` to the hub repo ``repo_id`` (created if missing); returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    return api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message="Add MoH model (moh export-timm)")


def _classifier(raw: dict, checkpoint: str) -> tuple[str, TransNeXtConfig | ViTConfig]:
    """The network family and config of an image-classifier checkpoint; one line naming the kind otherwise."""
    arch = (raw.get("hyper_parameters") or {}).get("arch")
    keys = raw.get("state_dict") or {}
    if arch is None or not any(key.startswith("model.patch_embed.") for key in keys):
        raise SystemExit(f"moh export-timm: {checkpoint} is not an image-classifier checkpoint (no ViT or TransNeXt "
                         f"weights): export language models with `moh export-hf`.")
    if isinstance(arch, (TransNeXtConfig, ViTConfig)):
        return ("transnext" if isinstance(arch, TransNeXtConfig) else "vit"), arch
    if any(key.startswith("model.stages.") for key in keys):
        return "transnext", TransNeXtConfig(**arch)
    return "vit", ViTConfig(**arch)


def _module(family: str) -> str:
    """The package whose import registers the family's models with timm."""
    return "moh_lightning.models.transnext" if family == "transnext" else "moh_lightning.models.vit"


def _preprocessing(data: dict, arch: TransNeXtConfig | ViTConfig) -> dict:
    """Evaluation preprocessing of the data module the model was trained with."""
    mnist = "crop_scale" in data and "data_dir" not in data
    # As the data module normalised: its defaults averaged down to one channel for a grayscale classifier.
    mean, std = normalisation(arch.in_chans, data.get("mean"), data.get("std"),
                              MNIST_MEAN if mnist else IMAGENET_MEAN, MNIST_STD if mnist else IMAGENET_STD)
    return {"mean": mean, "std": std, "crop_pct": data.get("crop_pct", 1.0 if mnist else 0.875),
            "interpolation": data.get("interpolation", "bicubic")}


def _json(value):
    """Lists for tuples, so configs compare as JSON would store them."""
    return json.loads(json.dumps(value))


__all__ = ["describe", "export_timm", "model_card", "push_folder", "registered_name"]

"""Reading weights from other people: any weights file or hub id into a state dict, and the fit report.

Every place that starts a model from someone's weights (dense timm ViTs, TransNeXt and the authors' MoH models, dense
DiTs, the authors' MoH-DiT) needs the same three steps: find the file (a path, or a Hugging Face hub repo holding
one), read it without running code (``serialization.read_weights_file``), and take the network's weights out of
whatever wraps them (an EMA copy, a training checkpoint, a DDP ``module.`` prefix). What fits the model is then
reported in one line: missing, unexpected and mis-shaped keys.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from moh_lightning.serialization import read_weights_file

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")
#: Where training checkpoints keep the network's weights: EMA first, as sampling and evaluation use them.
WRAPPERS = ("ema", "state_dict_ema", "model", "state_dict")


def weights_path(source: str | Path, key: str) -> Path:
    """A local weights file for ``source``: a path, a hub repo id holding one weights file (``Chat-UniVi/MoH-ViT-S-75``)
    or a repo id and the file in it (``owner/name/file.pth``), through ``huggingface_hub`` (its cache first).
    ``key`` names the option in errors."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    source = str(source)
    if path.exists() or source.count("/") < 1 or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{key}={source!r}: no such weights file ({', '.join(WEIGHT_SUFFIXES)}), and not a hub "
                                f"repo id (owner/name).")
    import huggingface_hub

    parts = source.split("/")
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
    unreachable = f"{key}={source!r}: cannot fetch it from the Hugging Face hub"
    try:
        if not filename:
            files = [f for f in huggingface_hub.list_repo_files(repo_id) if f.endswith(WEIGHT_SUFFIXES)]
            if len(files) != 1:
                raise FileNotFoundError(f"{key}={source!r}: the hub repo holds {len(files)} weight files "
                                        f"({', '.join(files) or 'none'}); name one as {repo_id}/<file>.")
            filename = files[0]
        return Path(huggingface_hub.hf_hub_download(repo_id, filename))
    except FileNotFoundError:
        raise
    except Exception as error:  # offline, unknown repository, no access: one line says what to do
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise FileNotFoundError(f"{unreachable} ({reason}); download the weights file and give its path.") from None


def read_state_dict(source: str | Path, key: str, wrappers: Sequence[str] = WRAPPERS) -> dict[str, torch.Tensor]:
    """The network's weights in ``source`` (see ``weights_path``): the first of ``wrappers`` that the file holds, a
    ``moh fit`` checkpoint's ``model.`` weights, or the file itself; DDP's ``module.`` prefix removed."""
    return unwrap(read_weights_file(weights_path(source, key)), wrappers)


def unwrap(raw: dict, wrappers: Sequence[str] = WRAPPERS) -> dict[str, torch.Tensor]:
    """The state dict inside what a weights file holds (see ``read_state_dict``)."""
    from_fit = "pytorch-lightning_version" in raw          # the task's weights: the network's under ``model.``
    for wrapper in wrappers:
        if isinstance(raw.get(wrapper), dict):
            raw = raw[wrapper]
            break
    if from_fit:
        raw = {name.removeprefix("model."): value for name, value in raw.items()}
    return {name.removeprefix("module."): value for name, value in raw.items()}


def check_fit(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str, advice: str,
              fresh: Callable[[str], bool] = lambda name: False) -> None:
    """Stops in one line when ``state`` does not fit ``model``: keys missing (other than the ``fresh`` ones, such as
    new routers), keys left over, or tensors of another shape; ``advice`` says what to match."""
    own = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items()
             if k in own and v.shape != own[k].shape]
    missing = [k for k in own if k not in state and not fresh(k)]
    unexpected = [k for k in state if k not in own]
    if wrong or missing or unexpected:
        raise ValueError(f"{source} does not fit this model: {len(missing)} missing {missing[:2]}, {len(unexpected)} "
                         f"unexpected {unexpected[:2]}, {len(wrong)} of another shape {wrong[:2]}; {advice}")

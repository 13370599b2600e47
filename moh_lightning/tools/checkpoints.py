"""Loading ``moh fit`` checkpoints for the tools that evaluate or export them."""
from __future__ import annotations

from pathlib import Path

import torch

from moh_lightning.tasks.language_model import LanguageModel


def load_language_model(checkpoint: str | Path, map_location: str = "cpu") -> tuple[LanguageModel, dict]:
    """A trained ``LanguageModel`` in eval mode and its data module's hyper-parameters (tokenizer, ...)."""
    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint}: no such file; give a .ckpt written by `moh fit`.")
    raw = torch.load(path, map_location=map_location, weights_only=False)
    data_hparams = dict(raw.get("datamodule_hyper_parameters") or {})
    hparams = dict(raw["hyper_parameters"])
    hparams["init_from_hf"] = None  # the checkpoint already holds the converted weights
    task = LanguageModel(**{k: v for k, v in hparams.items() if not k.startswith("_")})
    task.configure_model()
    task.load_state_dict(raw["state_dict"])
    task.tokens_seen = raw.get("tokens_seen", 0)
    return task.eval(), data_hparams


__all__ = ["load_language_model"]

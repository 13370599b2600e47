"""``moh generate``: continue a prompt with a trained MoH language model."""
from __future__ import annotations

from typing import Literal

from jsonargparse.typing import NonNegativeFloat, OpenUnitInterval, PositiveInt

from moh_lightning.data.tokenizers import load_tokenizer
from moh_lightning.errors import BadValueError
from moh_lightning.models.hf_causal import HFCausalLM
from moh_lightning.tasks.checkpoints import load_language_model
from moh_lightning.tasks.language_model import complete


def generate(
        checkpoint: str | None = None,
        prompt: str = "def ",
        max_new_tokens: PositiveInt = 200,
        temperature: NonNegativeFloat = 0.8,
        top_k_tokens: PositiveInt | None = 50,
        top_p: OpenUnitInterval | Literal[1.0] = 1.0,
        seed: int = 0,
        num_samples: PositiveInt = 1,
        tokenizer: str | None = None,
        hf_folder: str | None = None,
) -> list[str]:
    """Continues a prompt with a trained MoH language model, decoding through the KV cache.

    Args:
        checkpoint: A ``.ckpt`` written by ``moh fit`` with a LanguageModel.
        prompt: Text to continue.
        max_new_tokens: Tokens to generate (fewer if EOS comes first or the context is full).
        temperature: Softmax temperature; 0 is greedy decoding.
        top_k_tokens: Sample among the k most likely tokens; None for all.
        top_p: Nucleus sampling mass; 1.0 turns it off.
        seed: Random seed of the sampler.
        num_samples: Continuations to draw.
        tokenizer: Tokenizer name or folder; the one the model was trained with when None (the folder's own for
            ``--hf_folder``).
        hf_folder: Or a folder from ``moh convert-hf`` / ``export-hf`` (any transformers causal LM folder).
    """
    if (checkpoint is None) == (hf_folder is None):
        raise SystemExit("moh generate: give exactly one of --checkpoint (a .ckpt) or --hf_folder (a folder).")
    if hf_folder is not None:
        model, tokenizer_name = _folder_model(hf_folder), tokenizer or hf_folder
    else:
        task, data_hparams = load_language_model(checkpoint)
        model, tokenizer_name = task.model, tokenizer or data_hparams.get("tokenizer")
    if tokenizer_name is None:
        raise BadValueError(f"checkpoint {checkpoint} does not record its tokenizer: pass --tokenizer.")
    tok = load_tokenizer(tokenizer_name, key="--tokenizer" if tokenizer else "tokenizer")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise BadValueError("--prompt is empty after tokenisation: give some text to continue.")
    texts = complete(model, ids, tok, max_new_tokens, temperature, top_k_tokens, top_p, seed, num_samples)
    for text in texts:
        print(prompt + text)
        print("-" * 40)
    return texts


def _folder_model(folder: str) -> HFCausalLM:
    """The transformers model of ``folder``, decoded as a checkpoint's; remote code only as ``moh lm-eval`` trusts it
    (the suite's own modelling files)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from moh_lightning.tools.lm_eval import remote_code_trusted

    if not Path(folder, "config.json").is_file():
        raise SystemExit(f"moh generate: --hf_folder {folder}: no config.json; write one with `moh export-hf` or "
                         f"`moh convert-hf`.")
    trusted = remote_code_trusted(Path(folder))
    return HFCausalLM(AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=trusted, dtype="auto")).eval()


__all__ = ["generate"]

"""``moh generate``: continue a prompt with a trained MoH language model."""
from __future__ import annotations

from moh_lightning.data.text import load_tokenizer
from moh_lightning.tasks.checkpoints import load_language_model


def generate(
        checkpoint: str,
        prompt: str = "def ",
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k_tokens: int | None = 50,
        top_p: float = 1.0,
        seed: int = 0,
        num_samples: int = 1,
        tokenizer: str | None = None,
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
        tokenizer: Tokenizer name or folder; the one the model was trained with when None.
    """
    task, data_hparams = load_language_model(checkpoint)
    tokenizer_name = tokenizer or data_hparams.get("tokenizer")
    if tokenizer_name is None:
        raise ValueError(f"checkpoint {checkpoint} does not record its tokenizer: pass --tokenizer.")
    tok = load_tokenizer(tokenizer_name)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("--prompt is empty after tokenisation: give some text to continue.")
    texts = task.complete(ids, tok, max_new_tokens, temperature, top_k_tokens, top_p, seed, num_samples)
    for text in texts:
        print(prompt + text)
        print("-" * 40)
    return texts


__all__ = ["generate"]

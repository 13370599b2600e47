"""Tokenizers of the language-model task: any Hugging Face tokenizer by name or path, or ``byte``: the ids of
transformers' ``ByT5Tokenizer`` (UTF-8 bytes + 3 special ids, no vocabulary file), encoded here with numpy since they
are just ``byte + 3``. Exported models carry ``exported_tokenizer``: the same ids from a plain ``tokenizer(text)``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from moh_lightning.errors import MissingDataError
from moh_lightning.hf_configs import MOH_MODEL_TYPES, family_config
from moh_lightning.hub import offline_unless_hub_answers

BYTE_TOKENIZER = "byte"
#: The folder of a run folder that holds the run's own copy of a tokenizer read from a local folder.
RUN_TOKENIZER = "tokenizer"
_BYTE_OFFSET = 3  # ByT5Tokenizer: pad 0, eos 1, unk 2, then the 256 byte values.
_SPECIAL = ("<pad>", "</s>", "<unk>")


class ByteTokenizer:
    """ByT5's byte-level tokenizer (``ByT5Tokenizer(extra_ids=0)``): the same ids, calls and decoded text.

    Kept here, not taken from transformers, so that the language-model default trains, generates and predicts on a
    core install (transformers comes with the ``hf`` extra); tests/tasks/test_language_model.py holds it to ByT5's.
    """

    pad_token_id, eos_token_id, unk_token_id = 0, 1, 2
    vocab_size = 256 + _BYTE_OFFSET

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [byte + _BYTE_OFFSET for byte in text.encode("utf-8")]
        return {"input_ids": ids + [self.eos_token_id] if add_special_tokens else ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; bytes that are no whole UTF-8 character are dropped, as ByT5 drops them."""
        parts, pending = [], bytearray()
        for i in ids:
            if _BYTE_OFFSET <= i < self.vocab_size:
                pending.append(i - _BYTE_OFFSET)
            elif i < _BYTE_OFFSET and not skip_special_tokens:
                parts += [pending.decode("utf-8", errors="ignore"), _SPECIAL[i]]
                pending = bytearray()
        return "".join([*parts, pending.decode("utf-8", errors="ignore")])


def load_tokenizer(name: str, key: str = "tokenizer"):
    """``byte`` (``ByteTokenizer``, built without any file) or a Hugging Face tokenizer.

    ``key`` names the setting in the one-line error raised when the tokenizer cannot be found or loaded.
    """
    if name == BYTE_TOKENIZER:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    advice = "give a tokenizer folder (written by save_pretrained), a hub id that is reachable or cached, or 'byte'"
    folder = Path(name).expanduser()
    if name.startswith(("/", "./", "../", "~")) and not folder.exists():
        raise MissingDataError(f"{key}={name!r}: no such folder; {advice}.")
    # A name that is no folder here is a hub id: offline, it is read from the cache or fails at once.
    offline = not folder.is_dir() and offline_unless_hub_answers()
    try:
        # A tokenizer runs no custom code here; the folders `moh convert-hf` / `export-hf` write hold a model's remote
        # code beside the tokenizer, which transformers would otherwise ask about, stopping a run at a prompt.
        return AutoTokenizer.from_pretrained(name, trust_remote_code=False, config=_moh_family_config(name))
    except (OSError, ValueError) as error:
        if offline:
            raise MissingDataError(f"{key}={name!r}: cannot load it: no folder {name} in {Path.cwd()}, and offline "
                                   f"no hub id {name} in the Hugging Face cache; {advice}.") from None
        # transformers' messages run over several lines; the first says what failed.
        reason = str(error).strip().splitlines()[0].rstrip(" :")
        raise MissingDataError(f"{key}={name!r}: cannot load it ({reason}); {advice}.") from None


def _moh_family_config(name: str):
    """The family's config of a folder ``moh convert-hf`` / ``export-hf`` / ``convert-llama`` wrote (``model_type``
    ``moh`` / ``moh_llama``), None for any other. Without it, transformers reads such a ``config.json`` without the
    remote code that defines its type, falls back to a config of no type and warns that a ``moh`` model instantiates
    a model of type ``""`` ("can yield errors"), when only the tokenizer is read."""
    file = Path(name).expanduser() / "config.json"
    if not file.is_file():
        return None
    raw = json.loads(file.read_text())
    return family_config(raw, name) if raw.get("model_type") in MOH_MODEL_TYPES else None


def tokenizer_identity(name: str, tokenizer) -> str:
    """What makes a tokenizer's ids: its class, vocabulary, rules and EOS, hashed; not the name it was loaded by.

    A local tokenizer folder retrained under the same path gets another identity, and so another cache entry.
    """
    if name == BYTE_TOKENIZER:
        return BYTE_TOKENIZER
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    blob = json.dumps([type(tokenizer).__name__, state, tokenizer.eos_token_id, tokenizer.all_special_tokens])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def encode(tokenizer, tokenizer_name: str, text: bytes | str) -> np.ndarray:
    """Token ids of one document followed by EOS."""
    if tokenizer_name == BYTE_TOKENIZER:
        raw = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int64) + _BYTE_OFFSET
    else:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    return np.append(ids, tokenizer.eos_token_id)


def exported_tokenizer(name: str, key: str = "tokenizer"):
    """The tokenizer ``name`` as ``moh export-hf`` saves it: a plain ``tokenizer(text)`` gives ``encode``'s ids
    without the EOS that ends a document, the ids the model was trained on.

    ``byte`` becomes a ``tokenizers`` fast tokenizer, whose ``tokenizer.json`` loads in ``transformers`` without
    remote code and in ``tokenizers`` itself: a ByteLevel pre-tokenizer (no regex, no prefix space) turns every UTF-8
    byte into one symbol, a BPE without merges maps it to byte + 3, pad / eos / unk are 0 / 1 / 2 as in ByT5, and
    nothing is appended (ByT5 appends EOS to every call). A Hugging Face tokenizer keeps its vocabulary with BOS / EOS
    insertion turned off.
    """
    from transformers import PreTrainedTokenizerFast

    if name == BYTE_TOKENIZER:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        symbols = bytes_to_unicode()  # the byte -> symbol table of the ByteLevel pre-tokenizer
        vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {symbols[b]: b + _BYTE_OFFSET for b in range(256)}
        backend = Tokenizer(models.BPE(vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        # split_special_tokens: text such as "</s>" stays bytes, as encode() read it for training.
        return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                       unk_token="<unk>", split_special_tokens=True)
    tokenizer = load_tokenizer(name, key)
    if isinstance(tokenizer, PreTrainedTokenizerFast):
        tokenizer.add_bos_token = tokenizer.add_eos_token = False  # rewrites the post-processor, saved with it
    probe = "def f(x):\n    return x"
    if tokenizer(probe)["input_ids"] != tokenizer(probe, add_special_tokens=False)["input_ids"]:
        raise ValueError(f"{key}={name!r}: {type(tokenizer).__name__} adds special tokens that cannot be turned off, "
                         f"so a plain call would not encode as training did; give a fast tokenizer (tokenizer.json).")
    return tokenizer


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2 ** 16 else np.dtype(np.uint32)

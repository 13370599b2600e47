"""``moh convert-hf``, ``convert-llama`` and ``export-hf``: MoH folders that ``transformers`` and lm-eval load."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from moh_lightning.data.tokenizers import exported_tokenizer, load_tokenizer
from moh_lightning.errors import BadValueError, MissingDataError
from moh_lightning.layers import activated_head_fraction
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.hf_causal import (
    HFCausalLM,
    build_hf_causal,
    check_layers,
    default_budget,
    export_hf_causal,
    family_config,
    query_heads,
    read_source_config,
)
from moh_lightning.models.llama import export_hf, from_hf
from moh_lightning.outputs import check_output_folder, created_folder
from moh_lightning.tasks.checkpoints import load_language_model, one_line_errors

DTYPES = ("float32", "bfloat16", "float16")
#: Files of which at least one is saved with any transformers tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")


def convert_hf(source: str, out: str, num_shared_heads: int | list[int] | None = None,
               top_k: int | list[int] | None = None, keep_all_heads: bool = False, dtype: str | None = None,
               router_dtype: str = "float32", overwrite: bool = False) -> str:
    """Converts any ``transformers`` causal LM whose attention goes through transformers' attention interface (Qwen2,
    Qwen3, Mistral, Phi-3, Gemma 2, LLaMA, ...) into a MoH folder with the parameter-free query-norm router.

    The first ``num_shared_heads`` heads of every layer are shared and ``top_k`` of the others kept per token, gates
    {0, 1} (paper section 4.4). The folder keeps the family's modelling code, weights and every setting of the source,
    loads with ``AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)`` and lm-eval's ``hf`` model, and is
    a valid ``init_from`` for continue-tuning (``continue_hf_75.yaml``). With every head kept (``--keep_all_heads
    true``) its logits are the source's.

    Args:
        source: The model: a local folder or a hub id.
        out: Folder to write (weights, config, ``hf_moh.py``, tokenizer, model card); refused when it holds anything
            already, unless ``overwrite``.
        num_shared_heads: Always-active heads per layer (the first ones), or a list with one per attention layer
            that MoH gates (for a family whose layers have heads of their own number, as Laguna's); half of each
            layer's heads when None. A hybrid's layers whose mixing does not go through the attention interface
            (linear attention, state space) stay dense and take no entry.
        top_k: Routed heads kept per token, or one per layer; half of each layer's routed heads (75% active) when
            None.
        keep_all_heads: Share every head of every layer (``num_shared_heads`` each layer's heads, ``top_k`` 0): the
            folder computes the source's logits, to check the conversion or to continue-tune from with another
            budget (``--model.init_args.arch.moh.*``). Takes neither ``num_shared_heads`` nor ``top_k``.
        dtype: Weight dtype of the written model (float32, bfloat16, float16); the source's when None.
        router_dtype: Precision of the query-norm scores: float32, or activation (the authors' code).
        overwrite: Write into an ``out`` that holds files already, replacing those of the same names.
    """
    if dtype is not None and dtype not in DTYPES:
        raise SystemExit(f"moh convert-hf: --dtype {dtype}: choose one of {', '.join(DTYPES)} (or leave it out for "
                         f"the source's).")
    if keep_all_heads and (num_shared_heads is not None or top_k is not None):
        raise SystemExit("moh convert-hf: --keep_all_heads true shares every head of every layer; leave out "
                         "--num_shared_heads and --top_k, or give them without it.")
    check_output_folder(out, "--out", overwrite)
    with one_line_errors("convert-hf"):
        config = read_source_config(source)
        heads = list(query_heads(family_config(config)).values())
        num_shared_heads = heads if keep_all_heads else num_shared_heads  # default_budget then keeps no routed one
        shared = [default_budget(h, s)[0] for h, s in zip(heads, _per_layer(num_shared_heads, heads,
                                                                            "--num_shared_heads"), strict=True)]
        kept = [default_budget(h, s)[1] if k is None else k
                for h, s, k in zip(heads, shared, _per_layer(top_k, heads, "--top_k"), strict=True)]
        moh = MoHConfig(num_shared_heads=_one_or_list(shared), top_k=_one_or_list(kept), router="query_norm",
                        router_dtype=router_dtype)
        model = build_hf_causal(config, moh, weights=source, dtype=getattr(torch, dtype) if dtype else "auto")
        family_only = check_layers(model)
    tokenizer = source_tokenizer(source)
    written_dtype = next(model.parameters()).dtype
    routed = [h - s for h, s in zip(heads, shared, strict=True)]
    budget = (f"{_one_or_list(shared)} shared + top-{_one_or_list(kept)} of {_one_or_list(routed)} routed heads per "
              f"layer") if not keep_all_heads else f"every head shared, {_one_or_list(shared)} per layer"
    if family_only:
        print(f"moh convert-hf: layers {', '.join(map(str, family_only))} keep {type(model.hf).__name__}'s own "
              f"attention: on four tokens the suite's head-sparse kernels differ from it there (by up to "
              f"{max(family_only.values()):.1e} of its largest output; it reads sinks, biases or scales from the "
              f"module itself); recorded as moh_family_attention in config.json", file=sys.stderr)
    with created_folder(out):
        export_hf_causal(model, out, tokenizer, source=(
            f"Converted by `moh convert-hf` from the transformers {type(model.hf).__name__} `{source}` "
            f"({written_dtype}): its weights and settings unchanged, the parameter-free query-norm router added "
            f"({budget}). Not yet continue-tuned: the starting point of paper section 4.4."))
    print(f"wrote {out}: {type(model.hf).__name__}, {budget} ({(sum(shared) + sum(kept)) / sum(heads):.0%} active), "
          f"{str(written_dtype).removeprefix('torch.')}"
          + ("" if tokenizer is not None else "; no tokenizer in the source: give lm-eval one (tokenizer=...)"))
    return out


def _per_layer(value: int | list[int] | None, heads: list[int], key: str) -> list:
    """``value`` for each layer of a model with ``heads`` per layer: a list checked to have one entry a layer."""
    if not isinstance(value, list):
        return [value] * len(heads)
    if len(value) != len(heads):
        raise BadValueError(f"{key} has {len(value)} entries for {len(heads)} attention layers: give one per layer or "
                         f"a single int.")
    return value


def _one_or_list(values: list[int]) -> int | list[int]:
    return values[0] if len(set(values)) == 1 else values


def source_tokenizer(source: str):
    """The tokenizer saved beside the weights of ``source``; None for a folder of weights alone (some families'
    tokenizer classes fail rather than say so when their vocabulary file is absent: CTRL's, BioGPT's)."""
    folder = Path(source).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        return load_tokenizer(source, key="source")
    except (MissingDataError, ImportError):
        return None  # a tokenizer this environment cannot build; the weights convert without it


def convert_llama(source: str, out: str, num_shared_heads: int | None = None, top_k: int | None = None,
                  dtype: str | None = None, overwrite: bool = False) -> str:
    """Converts a ``transformers`` LLaMA into a MoH-LLaMA folder that ``transformers`` and lm-eval load.

    Args:
        source: LLaMA checkpoint: a local folder or a hub id.
        out: Folder to write (weights, config, modelling code, tokenizer); refused when it holds anything already,
            unless ``overwrite``.
        num_shared_heads: Always-active heads per layer (the first ones); half of the heads when None.
        top_k: Routed heads kept per token; half of the routed heads (75% active) when None.
        dtype: Weight dtype of the written model (float32, bfloat16, float16); the source's when None.
        overwrite: Write into an ``out`` that holds files already, replacing those of the same names.
    """
    from transformers import AutoTokenizer

    if dtype is not None and dtype not in DTYPES:
        raise SystemExit(f"moh convert-llama: --dtype {dtype}: choose one of {', '.join(DTYPES)} (or leave it out "
                         f"for the source's).")
    check_output_folder(out, "--out", overwrite)
    with one_line_errors("convert-llama"):
        model = from_hf(source, num_shared_heads, top_k, dtype=getattr(torch, dtype) if dtype else "auto")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        tokenizer = None  # a weights-only folder; pass the tokenizer to lm-eval separately
    moh = model.config.moh
    with created_folder(out):
        export_hf(model, out, tokenizer, source=(
            f"Converted by `moh convert-llama` from the transformers LLaMA `{source}`: its weights unchanged, the "
            f"parameter-free query-norm router added ({moh.num_shared_heads} shared + top-{moh.top_k} routed "
            f"heads). Not yet continue-tuned: the starting point of paper section 4.4."))
    print(f"wrote {out}: {moh.num_shared_heads} shared + top-{moh.top_k} of "
          f"{model.config.num_heads - moh.num_shared_heads} routed heads "
          f"({model.config.activated_fraction:.0%} active)")
    return out


_TOKENIZER_NOTE = ("A plain `tokenizer(text)` gives the ids the model was trained on: no BOS and no EOS added "
                   "(training joined documents with EOS and added nothing else), so greedy `generate` continues a "
                   "prompt token for token as `moh generate --temperature 0` does, and stops at EOS as it does.")


def export_checkpoint(checkpoint: str, out: str, tokenizer: str | None = None, push_to_hub: str | None = None,
                      private: bool = False, overwrite: bool = False) -> str:
    """Exports a ``moh fit`` LanguageModel checkpoint to a ``transformers`` folder, optionally pushed to the hub.

    Every language model exports: learned or query-norm router, one head budget or one per layer, or dense. The
    folder holds the config, safetensors weights, the tokenizer (a plain call encodes as training did:
    ``exported_tokenizer``), the remote-code modelling file and a model card (README.md) with the head budget and the
    checkpoint it came from; it loads with
    ``AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)`` and lm-eval's ``hf`` model.

    Args:
        checkpoint: A ``.ckpt`` written by ``moh fit`` with a LanguageModel.
        out: Folder to write; refused when it holds anything already, unless ``overwrite``.
        tokenizer: Tokenizer name or folder saved beside the weights; the training tokenizer when None.
        push_to_hub: Hub repo id (``user/name``) to upload the folder to (created if absent), with the credentials
            ``huggingface_hub`` finds (``hf auth login`` or ``HF_TOKEN``).
        private: Create the hub repo private.
        overwrite: Write into an ``out`` that holds files already, replacing those of the same names.
    """
    check_output_folder(out, "--out", overwrite)
    task, data_hparams = load_language_model(checkpoint, tool="export-hf")
    name = tokenizer or data_hparams.get("tokenizer")
    source = checkpoint_provenance(checkpoint, task.tokens_seen, name, data_hparams)
    kind = type(task.model.hf if isinstance(task.model, HFCausalLM) else task.model).__name__
    said = (f"wrote {out}: {kind}, {activated_head_fraction(task.model):.1%} of heads active; load it with "
            f"AutoModelForCausalLM.from_pretrained('{out}', trust_remote_code=True), or `moh lm-eval --hf_folder "
            f"{out}`")
    with created_folder(out):
        if isinstance(task.model, HFCausalLM):
            export_hf_causal(task.model, out, exported_tokenizer(name) if name else None, source=source,
                             name=push_to_hub)
        else:
            export_hf(task.model, out, exported_tokenizer(name) if name else None, source=source, name=push_to_hub,
                      tokenizer_note=_TOKENIZER_NOTE if name else None)
    print(said)
    if push_to_hub:
        url = push_folder(out, push_to_hub, private)
        print(f"pushed {out} to {url}")
    return out


def checkpoint_provenance(checkpoint: str, tokens_seen: int, tokenizer: str | None, data_hparams: dict) -> str:
    """The model card's provenance paragraph of a ``moh fit`` checkpoint."""
    lines = [f"Exported by `moh export-hf` from the `moh fit` checkpoint `{Path(checkpoint).name}` "
             f"({tokens_seen:,} training tokens), tokenizer `{tokenizer}`."]
    sources = data_hparams.get("sources")
    if sources:
        lines.append(f"Training data sources: `{sources}`.")
    if data_hparams.get("provenance"):  # checkpoints written from released weights say which (moh load-authors-*)
        lines.append(data_hparams["provenance"])
    return " ".join(lines)


def push_folder(folder: str | Path, repo_id: str, private: bool = False) -> str:
    """Uploads ``folder`` to the hub model repo ``repo_id`` (created when absent); returns the repo's URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                      commit_message="Upload MoH-LLaMA exported by moh-lightning")
    return str(url)


__all__ = ["DTYPES", "checkpoint_provenance", "convert_hf", "convert_llama", "export_checkpoint", "push_folder",
           "source_tokenizer"]

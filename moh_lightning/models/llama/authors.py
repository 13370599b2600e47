"""The authors' MoH-LLaMA3-8B (SkyworkAI/MoH, ``Chat-UniVi/MoH-LLaMA3-8B``) in the suite's MoH-LLaMA.

Apart from ``convert`` (any ``transformers`` LLaMA) because their release is one particular model, whose head budget
lives in their modelling code rather than in its config.

Their release is a Hugging Face folder: LLaMA3-8B's config, tokenizer and weights under transformers' LLaMA names,
with their own modelling code (``MoH-LLaMA3/Inference_code/modeling_llama.py``) for ``trust_remote_code``. The MoH
part has no weights and no config key: every attention layer of that code hard-codes the budget,

    shared_head = int(num_heads * 0.5)            # the first 16 of LLaMA3-8B's 32 heads, always on
    routed_head = int(num_heads * (0.75 - 0.5))   # routed heads kept per token: 8 of the other 16 (75% active)

and gates the head outputs before ``o_proj`` with the query-norm router: for each token, the l2 norm of each routed
head's query (the ``q_proj`` output, before rotary embedding), divided by the (unbiased) standard deviation of those
norms across the routed heads, softmax, the top ``routed_head`` get gate 1 and the others 0; shared heads gate 1.
That is the suite's ``QueryNormRouter`` (``router: query_norm``), which this loader builds with their budget. The
suite clamps the standard deviation at 1e-6 (theirs would divide by zero if every routed query of a token had the
same norm), and by default it scores in fp32 where theirs scores in the activations' dtype: in bf16 the two then keep
different heads where scores tie after rounding. ``router_dtype="activation"`` scores as theirs does, which
reproduces their bf16 head choices (``tests/models/llama/test_llama_authors.py`` against their code's output). Their
model computes no load-balance loss. The rest is LLaMA: the weights map as for any ``transformers`` LLaMA
(``convert.hf_to_moh_state_dict``).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from moh_lightning.models.llama.config import LlamaConfig
from moh_lightning.models.llama.convert import hf_to_moh_state_dict, llm_config_from_hf, moh_to_hf_state_dict
from moh_lightning.models.llama.network import MoHLlama, RotaryEmbedding
from moh_lightning.serialization import read_weights_file

AUTHORS_LLAMA_HUB = "Chat-UniVi/MoH-LLaMA3-8B"
#: Files of a Hugging Face model folder the loader needs (no modelling code is downloaded or run).
FOLDER_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken"]


def authors_budget(num_heads: int) -> tuple[int, int]:
    """(shared heads, routed heads kept per token) as their modelling code computes them from the head count."""
    return int(num_heads * 0.5), int(num_heads * (0.75 - 0.5))


def model_folder(source: str) -> Path:
    """A local Hugging Face model folder, or the hub repo's config, tokenizer and weights downloaded into the cache."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"--source {source}: not a model folder nor a hub repo id.")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=FOLDER_FILES))
    except OSError as error:  # huggingface_hub's HTTP and offline errors are OSErrors
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OSError(f"--source {source}: cannot fetch it from the hub ({reason}); download the folder (config, "
                      f"tokenizer, *.safetensors) and give its path.") from None


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All weights of a Hugging Face folder: safetensors (one file or the shards of its index), else ``*.bin``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    else:
        files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors or pytorch_model*.bin weights.")
    state = {}
    for file in files:
        state.update(read_weights_file(file))
    return state


def authors_llama_config(folder: Path, router_dtype: str = "float32") -> LlamaConfig:
    """The suite's config of their model: the folder's LLaMA config with their query-norm head budget."""
    from transformers import LlamaConfig as HFLlamaConfig

    hf_config = HFLlamaConfig.from_pretrained(folder)  # LLaMA's keys only: their modelling code is not run
    shared, top_k = authors_budget(hf_config.num_attention_heads)
    config = llm_config_from_hf(hf_config, num_shared_heads=shared, top_k=top_k)
    return replace(config, moh=replace(config.moh, router_dtype=router_dtype))


def load_authors_llama(source: str, dtype: torch.dtype | None = None, router_dtype: str = "float32") -> MoHLlama:
    """Their MoH-LLaMA3 (folder or hub id) as the suite's ``MoHLlama`` with their query-norm budget, every key used.

    The model is built without memory (meta device) and takes the checkpoint's tensors, so an 8B model costs its
    weights once, in their dtype unless ``dtype`` is given. ``router_dtype`` is the router's precision
    (``QueryNormRouter``): ``"activation"`` is theirs.
    """
    folder = model_folder(source)
    config = authors_llama_config(folder, router_dtype)
    weights = read_weights(folder)
    try:
        state = hf_to_moh_state_dict(weights, config)
    except KeyError as error:
        raise ValueError(f"{source}: the weight {error} that its config.json needs is missing.") from None
    unused = sorted(set(weights) - set(moh_to_hf_state_dict(state, config)) - {"lm_head.weight"})
    if unused:
        raise ValueError(f"{source}: weights that a LLaMA with its query-norm router does not have: {unused[:6]}")
    if dtype is not None:
        state = {name: value.to(dtype) for name, value in state.items()}
    with torch.device("meta"):
        model = MoHLlama(config)
    expected = model.state_dict()
    reshaped = [f"{name} {tuple(state[name].shape)} vs {tuple(value.shape)}" for name, value in expected.items()
                if name in state and state[name].shape != value.shape]
    if reshaped:
        raise ValueError(f"{source}: weights of other shapes than its config.json (weights vs config): {reshaped[:4]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.rope = RotaryEmbedding(config.head_dim, config.rope_base)  # its table is not a weight: built here
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


__all__ = ["AUTHORS_LLAMA_HUB", "FOLDER_FILES", "authors_budget", "authors_llama_config", "load_authors_llama",
           "model_folder", "read_weights"]

"""A language model continue-tuned from a Hugging Face model (``model.init_args.init_from``) is that model's network
read with its tokenizer: what ``moh`` fills into a run's config before it is built, so that its ``config.yaml``
records what ran."""
from __future__ import annotations

import sys
from collections.abc import Callable

from moh_lightning.models.hf_causal import read_source_config
from moh_lightning.tasks.language_model import not_the_sources, source_arch


def _language_model_args(config):
    model = config.get("model")
    init_args = getattr(model, "init_args", None)
    if init_args is None or not str(getattr(model, "class_path", "")).endswith("LanguageModel"):
        return None
    return init_args


def tokenizer_of_init_from(config) -> None:
    """A language model continue-tuned from a pretrained one reads that model's tokenizer unless the data module
    names another: the byte default would feed it ids its embedding never learnt."""
    model_args = _language_model_args(config)
    data_args = getattr(config.get("data"), "init_args", None)
    if model_args is None or data_args is None:
        return
    init_from = model_args.get("init_from")
    if init_from and data_args.get("tokenizer") == "byte":
        data_args.tokenizer = init_from
        print(f"moh: data.init_args.tokenizer={init_from} (init_from's own; --data.init_args.tokenizer gives another)",
              file=sys.stderr)


def network_of_init_from(config, named_model_keys: Callable[[], dict]) -> None:
    """The source's shapes and head budget fill each ``arch`` key this command leaves unnamed (``named_model_keys``:
    the ``model.init_args`` keys its configs and options name), so a partial ``moh`` (``top_k 2`` on a 2-shared
    source) keeps the source's other keys, and its ``transformers`` config fills ``hf_config`` (Granite's multipliers,
    Gemma's activation: what no ``arch`` key says). A shape named otherwise than the source's stops in one line."""
    init_args = _language_model_args(config)
    if init_args is None or init_args.get("arch") is None:
        return
    source = init_args.get("init_from") or init_args.get("init_from_hf")
    if not source:
        return
    try:
        source_config = read_source_config(source)
        network = source_arch(source_config)
    except (OSError, ValueError):
        return  # LanguageModel stops on it in one line
    if init_args.get("hf_config") is None:  # the family's own settings, so that config.yaml alone builds the network
        init_args.hf_config = source_config
    named = [key.removeprefix("arch.") for key in named_model_keys() if key.startswith("arch.")]
    dense = init_args.arch.get("moh") is None
    for key in named:  # a shape named otherwise than the source's, before the budget is checked against it
        if key in network and not key.startswith("moh.") and init_args.get(f"arch.{key}") != network[key]:
            raise SystemExit(f"moh: {not_the_sources(key, init_args.get(f'arch.{key}'), network[key], source)}")
    for key, value in network.items():
        if not (key in named or any(key.startswith(f"{name}.") for name in named) or
                (dense and key.startswith("moh."))):
            init_args[f"arch.{key}"] = value

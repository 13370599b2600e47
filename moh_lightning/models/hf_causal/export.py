"""An ``HFCausalLM`` as a ``transformers`` folder: the family's weights and config, the head budget and ``hf_moh.py``.

The folder loads with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` and lm-eval's ``hf``
model; ``config.json``'s ``model_type`` is ``moh`` (``hf_moh``'s docstring lists the fields), so that loading it
without ``trust_remote_code`` stops instead of running every head. A dense model is written as the plain family.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from moh_lightning.layers import moh_layers, query_norm
from moh_lightning.models.hf_causal.checks import family_attention_layers
from moh_lightning.models.hf_causal.network import HFCausalLM, attention_layers, config_budget, layer_heads

# The remote code, read from beside this file so that writing a folder needs no transformers import of its own.
_REMOTE_CODE = Path(__file__).with_name("hf_moh.py")
_GATE_FILE = Path(query_norm.__file__).name
_MOH_KEYS = ("moh_num_shared_heads", "moh_top_k", "moh_router", "moh_router_dtype", "moh_base_model_type",
             "moh_two_stage_routing", "moh_family_attention")


def export_hf_causal(model: HFCausalLM, folder: str | Path, tokenizer=None, source: str = "not recorded",
                     name: str | None = None) -> Path:
    """Writes ``model`` to ``folder`` (safetensors in the model's dtype, config, tokenizer if given, ``hf_moh.py``
    for a MoH model, and a model card README.md with the head budget and ``source``, where the weights came from)."""
    folder = Path(folder)
    hf = model.hf
    hf.save_pretrained(folder)
    file = folder / "config.json"
    config = json.loads(file.read_text())
    for key in ("auto_map", *_MOH_KEYS):  # a MoH source's fields, rewritten below for a MoH model
        config.pop(key, None)
    moh = bool(moh_layers(model))
    if moh:
        shared, top_k = config_budget(hf)
        config.update(model_type="moh", moh_base_model_type=hf.config.model_type, moh_num_shared_heads=shared,
                      moh_top_k=top_k, moh_router="query_norm",
                      moh_router_dtype=moh_layers(model)[0].router.score_dtype,
                      auto_map={"AutoConfig": f"{_REMOTE_CODE.name[:-3]}.MoHConfig",
                                "AutoModelForCausalLM": f"{_REMOTE_CODE.name[:-3]}.MoHForCausalLM"})
        if family_attention_layers(hf):  # the layers where conversion found the suite's kernels to differ
            config["moh_family_attention"] = family_attention_layers(hf)
        shutil.copyfile(_REMOTE_CODE, folder / _REMOTE_CODE.name)
        shutil.copyfile(query_norm.__file__, folder / _GATE_FILE)
    else:
        for name in (_REMOTE_CODE.name, _GATE_FILE):
            (folder / name).unlink(missing_ok=True)
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text(model_card(model, source, name or str(folder)))
    return folder


def model_card(model: HFCausalLM, source: str, name: str) -> str:
    """The README.md of an exported folder: how to load it, its head budget, family and provenance."""
    config = model.hf.config
    layers = moh_layers(model)
    attention = attention_layers(model.hf)
    total = sum(layer_heads(layer, config) for layer in attention)
    remote = ", trust_remote_code=True" if layers else ""
    # AutoTokenizer reads config.json first: without the model's config it would ask whether to run the remote code,
    # or, refused it, warn that a `moh` model instantiates a model of no type.
    local = ", config=model.config" if layers else ""
    if layers:
        active = sum(layer.active_heads for layer in layers)
        what = (f"A `{type(model.hf).__name__}` with Mixture-of-Head attention (MoH, Jin et al., ICML 2025, arXiv "
                f"2410.11842) through transformers' attention interface: the family's modelling code runs unchanged "
                f"and `{_REMOTE_CODE.name}` registers the MoH attention (hence `trust_remote_code=True`). Router: the "
                f"parameter-free query-norm router of paper section 4.4 (the first shared heads always on; among the "
                f"others each token keeps the top-k by query norm over the standard deviation of those norms, gate 1, "
                f"the rest 0).")
        gated = {layer.layer_idx: layer.moh_heads for layer in attention}
        dense = config.num_hidden_layers - len(gated)
        # A hybrid's other layers (linear attention, state space) never call the attention interface: no gates.
        budget = [f"Activated heads: {active} of {total} ({active / total:.1%})"
                  + (f" in the {len(gated)} layers whose attention goes through transformers' attention interface; "
                     f"the other {dense} are dense (their mixing does not go through it, so no head is gated)."
                     if dense else "."), "",
                  "| layer | heads | shared | top-k routed |", "|---|---|---|---|",
                  *(f"| {i} | {gated[i].num_heads} | {gated[i].num_shared_heads} | {gated[i].router.top_k} |"
                    if i in gated else f"| {i} | - | dense | - |" for i in range(config.num_hidden_layers))]
    else:
        what = f"A dense `{type(model.hf).__name__}` (every head active), a plain transformers folder."
        budget = [f"Dense: all {total} heads."]
    usage = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             f'model = AutoModelForCausalLM.from_pretrained("{name}"{remote})',
             f'tokenizer = AutoTokenizer.from_pretrained("{name}"{local})', "```", "",
             f"lm-eval: `lm_eval --model hf --model_args pretrained={name}{remote.replace(', ', ',')} --tasks sciq`"]
    header = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- moh",
              "- mixture-of-head-attention", *(["- custom_code"] if layers else []), "---", ""]
    return "\n".join([*header, f"# {Path(name).name}", "", what, "", *usage, "", "## Head budget", "", *budget, "",
                      "## Provenance", "", source, ""])


__all__ = ["export_hf_causal", "model_card"]

"""Pretrained ``transformers`` LLaMA <-> MoH-LLaMA (paper section 4.4: continue-tuning LLaMA3-8B into MoH).

``from_hf`` turns a ``LlamaForCausalLM`` (local folder or hub id) into ``MoHLlama`` with the parameter-free
query-norm router: the first ``num_shared_heads`` heads of every layer are shared (half by default, as the
paper does) and ``top_k`` routed heads are kept per token. With every head kept the converted model computes
exactly the original's logits. ``export_hf`` writes any MoH-LLaMA (learned or query-norm router, one budget or one
per layer) or dense model back to a folder that ``transformers`` loads: safetensors weights under LLaMA's names (the
learned routers under ``self_attn.router.*``), the config, a model card with the head budget and where the weights
came from, and ``hf_moh_llama.py`` as ``trust_remote_code`` modelling code, so lm-eval's own ``hf`` model type can
evaluate it. It stands apart from the network because it speaks ``transformers``' names and configs, which the
decoder itself never needs.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.llama.config import LlamaConfig
from moh_lightning.models.llama.network import MoHLlama

# The learned router's linears (``MoHRouter``), under the same names in the suite and in exported folders.
ROUTER_LINEARS = ("shared_router", "routed_router", "type_router")


def llm_config_from_hf(hf_config, num_shared_heads: int | None = None, top_k: int | None = None,
                       dense: bool = False) -> LlamaConfig:
    """Our config for a ``transformers`` ``LlamaConfig``; defaults keep half the heads shared and route to 75%.

    ``top_k`` defaults to half the routed heads (75% active); ``top_k`` = all routed heads is 100%.
    """
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} in the LLaMA config: only the default rotary embedding "
                         f"(LLaMA 1/2/3.0) is supported.")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r} in the LLaMA config: SwiGLU needs 'silu'.")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError("attention_bias / mlp_bias in the LLaMA config: MoH-LLaMA has no biases.")
    n_head = hf_config.num_attention_heads
    shared = n_head // 2 if num_shared_heads is None else num_shared_heads
    if top_k is None:
        top_k = max(1, (n_head - shared) // 2) if n_head > shared else 0
    return LlamaConfig(
        vocab_size=hf_config.vocab_size,
        depth=hf_config.num_hidden_layers,
        embed_dim=hf_config.hidden_size,
        num_heads=n_head,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_head,
        num_kv_heads=hf_config.num_key_value_heads,
        intermediate_size=hf_config.intermediate_size,
        block_size=hf_config.max_position_embeddings,
        rope_base=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
        norm_eps=hf_config.rms_norm_eps,
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        moh=None if dense else MoHConfig(num_shared_heads=shared, top_k=top_k, router="query_norm"),
    )


def hf_to_moh_state_dict(hf_state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` weights under ``MoHLlama``'s names (q, k, v stacked into ``qkv``)."""
    out = {"embed.weight": hf_state["model.embed_tokens.weight"], "norm.weight": hf_state["model.norm.weight"],
           "lm_head.weight": hf_state.get("lm_head.weight", hf_state["model.embed_tokens.weight"])}
    for i in range(config.depth):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        attn = hf + "self_attn."
        out[ours + "attn.qkv.weight"] = torch.cat(
            [hf_state[attn + "q_proj.weight"], hf_state[attn + "k_proj.weight"], hf_state[attn + "v_proj.weight"]])
        out[ours + "attn.proj.weight"] = hf_state[attn + "o_proj.weight"]
        out[ours + "attn_norm.weight"] = hf_state[hf + "input_layernorm.weight"]
        out[ours + "mlp_norm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[ours + f"mlp.{proj}.weight"] = hf_state[hf + f"mlp.{proj}.weight"]
        for name in ROUTER_LINEARS:  # learned routers, present in folders exported from learned-router models
            if f"{attn}router.{name}.weight" in hf_state:
                out[f"{ours}attn.router.{name}.weight"] = hf_state[f"{attn}router.{name}.weight"]
    return out


def moh_to_hf_state_dict(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """``MoHLlama`` weights under ``LlamaForCausalLM``'s names (the inverse of ``hf_to_moh_state_dict``)."""
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.depth):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        q, k, v = state[ours + "attn.qkv.weight"].split([q_size, kv_size, kv_size])
        attn = hf + "self_attn."
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v,
                    attn + "o_proj.weight": state[ours + "attn.proj.weight"],
                    hf + "input_layernorm.weight": state[ours + "attn_norm.weight"],
                    hf + "post_attention_layernorm.weight": state[ours + "mlp_norm.weight"]})
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[hf + f"mlp.{proj}.weight"] = state[ours + f"mlp.{proj}.weight"]
        for name in ROUTER_LINEARS:
            if f"{ours}attn.router.{name}.weight" in state:
                out[f"{attn}router.{name}.weight"] = state[f"{ours}attn.router.{name}.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _load_hf_model(source: str, dtype: torch.dtype | None = None):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as error:
        raise OSError(f"LLaMA checkpoint {source!r}: cannot load it ({error}); give a local folder with "
                      f"config.json and weights, or a hub id reachable from here.") from error


def from_hf(source: str, num_shared_heads: int | None = None, top_k: int | None = None, dense: bool = False,
            dtype: torch.dtype | None = None) -> MoHLlama:
    """A ``MoHLlama`` with the weights of a ``transformers`` LLaMA (folder or hub id); see ``llm_config_from_hf``."""
    hf = _load_hf_model(source, dtype)
    config = llm_config_from_hf(hf.config, num_shared_heads, top_k, dense)
    model = MoHLlama(config).to(hf.dtype)
    model.load_state_dict(hf_to_moh_state_dict(hf.state_dict(), config), strict=True)
    return model.eval()


def layer_budgets(config: LlamaConfig) -> list[tuple[int, int]]:
    """(shared heads, routed heads kept per token) of every layer of a MoH model, each checked."""
    return [(layer["num_shared_heads"], layer["top_k"]) for layer in config.moh.layers(config.num_heads, config.depth)]


def hf_config_for(config: LlamaConfig, **extra):
    """The ``transformers`` config of an exported model: plain LLaMA when dense, else ``MoHLlamaConfig``.

    The head budget is one int for every layer when the layers share it, else one entry per layer.
    """
    from transformers import LlamaConfig as HFLlamaConfig

    from moh_lightning.models.llama.hf_moh_llama import MoHLlamaConfig

    moh = config.moh
    kwargs = dict(
        vocab_size=config.vocab_size, hidden_size=config.embed_dim, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.depth, num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_base},
        tie_word_embeddings=config.tie_embeddings, hidden_act="silu", **extra,
    )
    if moh is None:
        return HFLlamaConfig(**kwargs)
    if moh.router not in ("learned", "query_norm"):
        raise ValueError(f"arch.moh.router={moh.router!r}: the exported modelling code knows 'learned' and "
                         f"'query_norm'.")
    shared, top_k = (list(values) for values in zip(*layer_budgets(config), strict=True))
    return MoHLlamaConfig(moh_num_shared_heads=shared[0] if len(set(shared)) == 1 else shared,
                          moh_top_k=top_k[0] if len(set(top_k)) == 1 else top_k, moh_router=moh.router,
                          moh_router_dtype=moh.router_dtype, moh_two_stage_routing=moh.two_stage_routing, **kwargs)


_ROUTER_TEXT = {
    "learned": "learned two-stage router (paper Eq. 5-6 at the authors' scale: shared gates softmax(W_s x) * h_s, "
               "routed gates softmax(W_r x) kept on the top-k, renormalised and * k, the two groups weighted by "
               "2 * softmax(W_h x))",
    "query_norm": "parameter-free query-norm router (paper section 4.4: each routed head scored by its query norm "
                  "over the standard deviation of those norms across the routed heads; the top-k get gate 1)",
}


def model_card(config: LlamaConfig, source: str, name: str, tokenizer_note: str | None = None) -> str:
    """The README.md of an exported folder: how to load it, its head budget, architecture and provenance.

    ``source`` says where the weights came from (a ``moh fit`` checkpoint, a converted LLaMA, the authors' release);
    ``name`` is the hub repo id or folder the snippets load; ``tokenizer_note`` says how the tokenizer encodes.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        suite = f"moh-lightning {version('moh-lightning')}"
    except PackageNotFoundError:
        suite = "moh-lightning"
    moh = config.moh
    remote = ", trust_remote_code=True" if moh is not None else ""
    header = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- moh",
              "- mixture-of-head-attention", *(["- custom_code"] if moh is not None else []), "---", ""]
    if moh is None:
        what = f"A dense LLaMA-style decoder (every head active), exported by {suite} as a plain `LlamaForCausalLM`."
        budget = [f"Dense: all {config.num_heads} heads of every layer (100%)."]
    else:
        what = (f"A LLaMA-style decoder with Mixture-of-Head attention (MoH, Jin et al., ICML 2025, arXiv "
                f"2410.11842): per token a router keeps the shared heads and picks the top-k routed heads, and the "
                f"heads' outputs are summed with the routing scores as weights. Exported by {suite}; the modelling "
                f"code is `hf_moh_llama.py` in this folder (hence `trust_remote_code=True`).")
        budgets = layer_budgets(config)
        active = [shared + (top_k if config.num_heads > shared else 0) for shared, top_k in budgets]
        total = config.num_heads * config.depth
        budget = [f"Router: {_ROUTER_TEXT[moh.router]}.", "",
                  f"Activated heads: {sum(active)} of {total} ({sum(active) / total:.1%}).", "",
                  "| layers | heads | shared | routed | top-k | active per token |", "|---|---|---|---|---|---|"]
        start = 0
        for end in range(1, len(budgets) + 1):  # one row per run of layers with the same budget
            if end == len(budgets) or budgets[end] != budgets[start]:
                shared, top_k = budgets[start]
                routed = config.num_heads - shared
                span = str(start) if end - 1 == start else f"{start}-{end - 1}"
                budget.append(f"| {span} | {config.num_heads} | {shared} | {routed} | {top_k if routed else 0} | "
                              f"{active[start]} |")
                start = end
    architecture = (f"{config.depth} layers, width {config.embed_dim}, {config.num_heads} heads of {config.head_dim} "
                    f"({config.num_kv_heads} key/value heads), SwiGLU {config.intermediate_size}, RMSNorm eps "
                    f"{config.norm_eps:g}, rotary base {config.rope_base:g}, vocabulary {config.vocab_size}, "
                    f"context {config.block_size}, {'tied' if config.tie_embeddings else 'untied'} embeddings.")
    # AutoTokenizer reads config.json first: without the model's config it would ask whether to run the remote code,
    # or, refused it, warn that a `moh_llama` model instantiates a model of no type.
    local = ", config=model.config" if moh is not None else ""
    usage = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             f'model = AutoModelForCausalLM.from_pretrained("{name}"{remote})',
             f'tokenizer = AutoTokenizer.from_pretrained("{name}"{local})',
             'inputs = tokenizer("def parse(", return_tensors="pt")',
             "output = model.generate(**inputs, max_new_tokens=50, do_sample=False)",
             "print(tokenizer.decode(output[0], skip_special_tokens=True))", "```", "",
             *([tokenizer_note, ""] if tokenizer_note else []),
             *(["The tokenizer runs no custom code: `trust_remote_code=False` loads it without the question "
                "transformers asks for the model's code.", ""] if moh is not None else []),
             f"lm-eval: `lm_eval --model hf --model_args pretrained={name}{remote.replace(', ', ',')} --tasks sciq`"]
    lines = [*header, f"# {Path(name).name}", "", what, "", *usage, "", "## Head budget", "", *budget, "",
             "## Architecture", "", architecture, "", "## Provenance", "", source, ""]
    return "\n".join(lines)


def export_hf(model: MoHLlama, folder: str | Path, tokenizer=None, source: str = "not recorded",
              name: str | None = None, tokenizer_note: str | None = None) -> Path:
    """Writes ``model`` as a ``transformers`` folder (safetensors, config, modelling code, tokenizer if given, and a
    model card README.md naming the head budget and ``source``, where the weights came from).

    A MoH model loads with ``trust_remote_code=True``; a dense one is a plain ``LlamaForCausalLM``. ``name`` is the
    repo id or path the model card's snippets load (the folder when None); ``tokenizer_note``, a paragraph of the
    card, says how the tokenizer encodes.
    """
    from transformers import LlamaForCausalLM

    from moh_lightning.layers import query_norm
    from moh_lightning.models.llama import hf_moh_llama
    from moh_lightning.models.llama.hf_moh_llama import MoHLlamaConfig, MoHLlamaForCausalLM

    folder = Path(folder)
    special = {}
    if tokenizer is not None:
        special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id}
    hf_config = hf_config_for(model.config, **special)
    moh = isinstance(hf_config, MoHLlamaConfig)
    if moh:
        # Written by hand, not by registering the classes for the auto classes: save_pretrained would then copy the
        # relative import of the gate's file from beside hf_moh_llama.py, where the package does not keep it.
        remote = Path(hf_moh_llama.__file__).stem
        hf_config.auto_map = {"AutoConfig": f"{remote}.MoHLlamaConfig",
                              "AutoModelForCausalLM": f"{remote}.MoHLlamaForCausalLM"}
        hf_model = MoHLlamaForCausalLM(hf_config)
    else:
        hf_model = LlamaForCausalLM(hf_config)
    state = moh_to_hf_state_dict(model.state_dict(), model.config)
    hf_model.load_state_dict(state, strict=not model.config.tie_embeddings)
    hf_model.to(next(model.parameters()).dtype).save_pretrained(folder)
    if moh:
        for module in (hf_moh_llama, query_norm):
            shutil.copyfile(module.__file__, folder / Path(module.__file__).name)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text(model_card(model.config, source, name or str(folder), tokenizer_note))
    return folder


__all__ = ["ROUTER_LINEARS", "export_hf", "from_hf", "hf_config_for", "hf_to_moh_state_dict", "layer_budgets",
           "llm_config_from_hf", "model_card", "moh_to_hf_state_dict"]

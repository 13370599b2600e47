"""The authors' MoH-LLaMA3 (SkyworkAI/MoH, a Hugging Face folder with their own modelling code) loaded into the
suite's MoH-LLaMA: every weight used, their hard-coded head budget, and logits equal to a re-computation written here
from their modelling code's formulas; `moh load-authors-llama` output evaluated by `moh lm-eval`.

Their code is never imported: the config keys their modelling code reads and the weight names and shapes of their
folder are written below as data.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, ByT5Tokenizer

from moh_lightning.cli import main as moh
from moh_lightning.layers import QueryNormRouter
from moh_lightning.tasks.checkpoints import load_language_model
from moh_lightning.tools.authors_llama import authors_budget, load_authors_llama

# The keys of config.json their modelling code reads (LLaMA3-8B's, at a tiny size: 8 heads of 8, 2 key/value heads).
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "auto_map": {
          "AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"}, "hidden_size": 64, "num_attention_heads": 8,
          "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 259,
          "max_position_embeddings": 64, "rope_theta": 5000.0, "rope_scaling": None, "rms_norm_eps": 1e-5,
          "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
          "tie_word_embeddings": False, "torch_dtype": "float32"}
QUESTIONS = [{"question": "the cat sat on the", "choices": [" mat", " sky"], "answer": 0},
             {"question": "a cat and a", "choices": [" dog", " mat"], "answer": 0}]


def their_weights(c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the names and shapes of their folder (transformers' LLaMA names, no router weights)."""
    generator = torch.Generator().manual_seed(seed)
    dim, heads, kv, inter, vocab = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                                    c["intermediate_size"], c["vocab_size"])
    d = dim // heads
    shapes = {"model.embed_tokens.weight": (vocab, dim), "model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * d, dim), p + "self_attn.k_proj.weight": (kv * d, dim),
                       p + "self_attn.v_proj.weight": (kv * d, dim), p + "self_attn.o_proj.weight": (dim, heads * d),
                       p + "mlp.gate_proj.weight": (inter, dim), p + "mlp.up_proj.weight": (inter, dim),
                       p + "mlp.down_proj.weight": (dim, inter), p + "input_layernorm.weight": (dim,),
                       p + "post_attention_layernorm.weight": (dim,)})
    return {name: (1 + 0.1 * torch.randn(shape, generator=generator)) if len(shape) == 1 else
            torch.randn(shape, generator=generator) * (1.0 if "embed" in name else shape[1] ** -0.5)
            for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A folder laid out as their hub release: config.json, sharded safetensors with an index, a tokenizer."""
    folder = tmp_path_factory.mktemp("moh_llama3")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    weights = their_weights(CONFIG)
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: weights[k].contiguous() for k in keys}, folder / shard, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    ByT5Tokenizer(extra_ids=0).save_pretrained(folder)
    return folder, weights


def their_logits(w: dict, c: dict, idx: torch.Tensor) -> torch.Tensor:
    """Their LlamaForCausalLM forward (fp32, no cache), from their modelling code's formulas."""
    heads, kv, eps = c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    d = c["hidden_size"] // heads
    shared, routed = int(heads * 0.5), int(heads * (0.75 - 0.5))
    batch, length = idx.shape
    rms = lambda x, g: g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731
    rotate_half = lambda x: torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)  # noqa: E731
    inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(length).float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][idx]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        hidden = rms(x, w[p + "input_layernorm.weight"])
        q = hidden @ w[p + "self_attn.q_proj.weight"].T
        k = (hidden @ w[p + "self_attn.k_proj.weight"].T).view(batch, length, kv, d).transpose(1, 2)
        v = (hidden @ w[p + "self_attn.v_proj.weight"].T).view(batch, length, kv, d).transpose(1, 2)
        # their router: query norms of the routed heads / their std across heads, softmax, top-k -> {0, 1}
        norms = q.view(-1, heads, d)[:, shared:].norm(dim=-1)
        scores = (norms / norms.std(dim=1, keepdim=True)).softmax(-1)
        mask = F.one_hot(scores.topk(routed, dim=1).indices, heads - shared).sum(1).view(batch, length, -1)
        mask = torch.cat([torch.ones_like(mask), mask], -1).float()
        q = q.view(batch, length, heads, d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(d)).masked_fill(~causal, float("-inf")).softmax(-1) @ v
        out = (att.transpose(1, 2) * mask[..., None]).reshape(batch, length, heads * d)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        hidden = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(hidden @ w[p + "mlp.gate_proj.weight"].T) * (hidden @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_their_release_loads_with_their_budget_and_computes_their_logits(release):
    folder, weights = release
    model = load_authors_llama(str(folder))
    moh_config = model.config.moh
    assert authors_budget(32) == (16, 8)  # LLaMA3-8B: 16 shared + top-8 of 16 routed, 75%
    assert (moh_config.num_shared_heads, moh_config.top_k, moh_config.router) == (4, 2, "query_norm")
    assert isinstance(model.blocks[0].attn.router, QueryNormRouter) and model.config.activated_fraction == 0.75
    assert (model.config.num_kv_heads, model.config.rope_base, model.config.block_size) == (2, 5000.0, 64)
    assert sum(p.numel() for p in model.parameters()) == sum(w.numel() for w in weights.values())
    idx = torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx)
        theirs = their_logits(weights, CONFIG, idx)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    kept = model.blocks[1].attn.last_gates[..., 4:]
    assert kept.sum(-1).eq(2).all() and len({tuple(row.tolist()) for row in kept.reshape(-1, 4)}) > 2


def test_missing_or_extra_weights_are_named(release, tmp_path):
    folder, weights = release
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(CONFIG))
    extra = {**weights, "model.layers.0.self_attn.wg.weight": torch.zeros(4, 64)}
    save_file({k: v.contiguous() for k, v in extra.items()}, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"does not have: \['model.layers.0.self_attn.wg.weight'\]"):
        load_authors_llama(str(broken))
    del extra["model.layers.0.self_attn.wg.weight"], extra["model.layers.1.mlp.up_proj.weight"]
    save_file({k: v.contiguous() for k, v in extra.items()}, broken / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_authors_llama(str(broken))
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        load_authors_llama(str(tmp_path / "absent"))


def test_load_authors_llama_writes_what_lm_eval_and_transformers_read(release, tmp_path):
    folder, weights = release
    moh(["load-authors-llama", "--source", str(folder), "--out", str(tmp_path / "authors.ckpt")])
    task, data_hparams = load_language_model(tmp_path / "authors.ckpt")
    assert data_hparams["tokenizer"] == str(folder.resolve()) and "SkyworkAI/MoH" in data_hparams["provenance"]
    idx = torch.randint(3, 259, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(task.model(idx), their_logits(weights, CONFIG, idx), atol=1e-5, rtol=1e-5)

    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_choice.yaml").write_text(
        f"task: tiny_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'data.jsonl'}\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n')
    moh(["lm-eval", "--checkpoint", str(tmp_path / "authors.ckpt"), "--tasks", "[tiny_choice]", "--include_path",
         str(tmp_path / "tasks"), "--include_defaults", "false", "--batch_size", "2", "--output",
         str(tmp_path / "results.json")])
    assert 0.0 <= json.loads((tmp_path / "results.json").read_text())["results"]["tiny_choice"]["acc,none"] <= 1.0

    moh(["load-authors-llama", "--source", str(folder), "--out", str(tmp_path / "hf")])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    assert (loaded.config.moh_num_shared_heads, loaded.config.moh_top_k) == (4, 2)
    assert "SkyworkAI/MoH" in (tmp_path / "hf" / "README.md").read_text()
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx).logits, their_logits(weights, CONFIG, idx), atol=1e-5, rtol=1e-5)


def test_hub_id_downloads_config_tokenizer_and_weights_but_no_code(release, monkeypatch):
    import huggingface_hub

    folder, _ = release
    asked = {}

    def snapshot_download(repo_id, allow_patterns):
        asked.update(repo_id=repo_id, patterns=allow_patterns)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = load_authors_llama("Chat-UniVi/MoH-LLaMA3-8B")
    assert asked["repo_id"] == "Chat-UniVi/MoH-LLaMA3-8B" and not any(p.endswith(".py") for p in asked["patterns"])
    assert model.config.moh.top_k == 2

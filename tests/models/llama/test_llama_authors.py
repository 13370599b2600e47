"""The authors' MoH-LLaMA3 (SkyworkAI/MoH, a Hugging Face folder with their own modelling code) loaded into the
suite's MoH-LLaMA: every weight used, their hard-coded head budget, and the logits and head choices of their own code
on the same weights (tests/data/golden_moh_llama.safetensors, written by tests/make_golden.py from their
``modeling_llama.py``); `moh load-authors-llama` output evaluated by `moh lm-eval`.
"""
from __future__ import annotations

import json

import pytest
import torch
from golden import load_golden, prefixed
from safetensors.torch import save_file
from tiny_models import tiny_llama_config
from transformers import AutoModelForCausalLM, ByT5Tokenizer

from moh_lightning.cli import main as moh
from moh_lightning.layers import MoHAttention, QueryNormRouter
from moh_lightning.models.llama import authors_budget, load_authors_llama
from moh_lightning.tasks.checkpoints import load_language_model
from moh_lightning.tasks.language_model import LanguageModel

GOLDEN, GOLDEN_META = load_golden("moh_llama")
# config.json of their release at the golden file's tiny size (LLaMA3-8B's layout: 8 heads of 8, 2 key/value heads).
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "auto_map": {
          "AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"}, **GOLDEN_META["spec"], "rope_scaling": None,
          "attention_dropout": 0.0, "pretraining_tp": 1, "torch_dtype": "float32"}

@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A folder laid out as their hub release (config.json, sharded safetensors with an index, a tokenizer) holding
    the golden file's weights."""
    folder = tmp_path_factory.mktemp("moh_llama3")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    weights = prefixed(GOLDEN, "weights")
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: weights[k].contiguous() for k in keys}, folder / shard, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    ByT5Tokenizer(extra_ids=0).save_pretrained(folder)
    return folder, weights


def _gates(model) -> list[torch.Tensor]:
    return [layer.last_gates.float() for layer in model.modules() if isinstance(layer, MoHAttention)]


def test_their_release_loads_with_their_budget_and_computes_their_logits(release):
    folder, weights = release
    assert GOLDEN_META["source"].startswith("SkyworkAI/MoH@")
    model = load_authors_llama(str(folder))
    moh_config = model.config.moh
    assert authors_budget(32) == (16, 8)  # LLaMA3-8B: 16 shared + top-8 of 16 routed, 75%
    assert (moh_config.num_shared_heads, moh_config.top_k, moh_config.router) == (4, 2, "query_norm")
    assert isinstance(model.blocks[0].attn.router, QueryNormRouter) and model.config.activated_fraction == 0.75
    assert (model.config.num_kv_heads, model.config.rope_base, model.config.block_size) == (2, 5000.0, 64)
    assert sum(p.numel() for p in model.parameters()) == sum(w.numel() for w in weights.values())
    with torch.no_grad():
        ours = model(GOLDEN["idx"])
    # Measured: bit-equal in fp32 (their SDPA path and the suite's compute the same operations).
    torch.testing.assert_close(ours, GOLDEN["float32.logits"], atol=1e-5, rtol=1e-5)
    for i, gates in enumerate(_gates(model)):
        assert torch.equal(gates, GOLDEN[f"float32.gates.{i}"])
    kept = model.blocks[1].attn.last_gates[..., 4:]
    assert kept.sum(-1).eq(2).all() and len({tuple(row.tolist()) for row in kept.reshape(-1, 4)}) > 2


def test_router_dtype_activation_makes_their_bf16_head_choices():
    """On the queries their bf16 model scored, ``router_dtype: activation`` keeps exactly their heads; fp32 scoring
    keeps others where bf16 scores tie (1 token of 96 in layer 0 here)."""
    spec = GOLDEN_META["spec"]
    heads, shared, top_k = spec["num_attention_heads"], *authors_budget(spec["num_attention_heads"])
    differing = 0
    for i in range(spec["num_hidden_layers"]):
        q = GOLDEN[f"bfloat16.queries.{i}"]                                            # (B, N, h * d), bf16
        q = q.view(*q.shape[:2], heads, -1).transpose(1, 2)
        theirs = GOLDEN[f"bfloat16.gates.{i}"]
        as_theirs = QueryNormRouter(heads, shared, top_k, "activation")(None, q=q).gates.float()
        assert torch.equal(as_theirs, theirs)
        exact = QueryNormRouter(heads, shared, top_k, "float32")(None, q=q).gates.float()
        differing += int((exact != theirs).any(-1).sum())
    assert differing > 0


def test_their_model_has_no_load_balance_loss_and_neither_has_the_query_norm_lm():
    """Their training loss is cross-entropy + 0.01 * l_aux with l_aux = 0 (no layer computes one); the suite's
    language model with the query-norm router defaults to beta = 0, the learned router to 0.01."""
    assert float(GOLDEN["train.l_aux"]) == 0.0
    assert torch.equal(GOLDEN["train.loss"], GOLDEN["train.cross_entropy"])

    learned = tiny_llama_config("tiny_75")
    assert learned.moh.router == "learned" and LanguageModel(learned).load_balance_beta == 0.01
    query_norm = tiny_llama_config("tiny_75")
    query_norm.moh.router = "query_norm"
    assert LanguageModel(query_norm).load_balance_beta == 0.0
    assert LanguageModel(query_norm, load_balance_beta=0.01).load_balance_beta == 0.01


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


@pytest.mark.slow
def test_load_authors_llama_writes_what_lm_eval_and_transformers_read(release, tmp_path):
    folder, weights = release
    moh(["load-authors-llama", "--source", str(folder), "--out", str(tmp_path / "authors.ckpt")])
    task, data_hparams = load_language_model(tmp_path / "authors.ckpt")
    assert data_hparams["tokenizer"] == str(folder.resolve()) and "SkyworkAI/MoH" in data_hparams["provenance"]
    idx, expected = GOLDEN["idx"], GOLDEN["float32.logits"]
    with torch.no_grad():
        torch.testing.assert_close(task.model(idx), expected, atol=1e-5, rtol=1e-5)

    moh(["lm-eval", "--checkpoint", str(tmp_path / "authors.ckpt"), "--tasks", "[python_basics]", "--include_path",
         "lm_eval_tasks", "--include_defaults", "false", "--batch_size", "2", "--output",
         str(tmp_path / "results.json")])
    assert 0.0 <= json.loads((tmp_path / "results.json").read_text())["results"]["python_basics"]["acc,none"] <= 1.0

    moh(["load-authors-llama", "--source", str(folder), "--out", str(tmp_path / "hf")])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    assert (loaded.config.moh_num_shared_heads, loaded.config.moh_top_k) == (4, 2)
    assert "SkyworkAI/MoH" in (tmp_path / "hf" / "README.md").read_text()
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx).logits, expected, atol=1e-5, rtol=1e-5)


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

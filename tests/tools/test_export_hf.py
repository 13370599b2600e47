"""`moh export-hf` for every MoH language model: learned router and per-layer budgets out to transformers, lm-eval's
`hf` model and (up to the upload call) the hub."""
from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM, ByT5Tokenizer

from moh_lightning.cli import main as moh
from moh_lightning.data.text import TextDataModule, TextSource
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.llama import LlamaConfig, MoHLlama, export_hf
from moh_lightning.tasks.checkpoints import load_language_model
from moh_lightning.tasks.language_model import LanguageModel

# 3 layers of 8 heads with grouped-query attention and one budget per layer: 2 shared + top-3 of 6 routed, no shared
# + top-2 of 8 (the routed-only router), all 8 shared (shared gates only).
ARCH = {"vocab_size": 259, "depth": 3, "embed_dim": 64, "num_heads": 8, "head_dim": 8, "num_kv_heads": 4,
        "intermediate_size": 96, "block_size": 64}
BUDGET = {"num_shared_heads": [2, 0, 8], "top_k": [3, 2, 0]}

def _sharpen_routers(model: MoHLlama) -> None:
    """Router weights of unit scale, so gates differ clearly from uniform and top-k choices vary by token."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".router." in name:
                param.normal_(0.0, 1.0)


@pytest.fixture(scope="module")
def learned(tmp_path_factory) -> Path:
    """A learned-router checkpoint written by a (two-step) Lightning fit, its export, and a local lm-eval task."""
    root = tmp_path_factory.mktemp("export_hf")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"{i}.txt").write_text("the cat sat on the mat. the dog sat on the mat.\n" * 6)
    dm = TextDataModule(sources=[TextSource(path=str(corpus), val_fraction=0.25)], seq_len=32, batch_size=4,
                        cache_dir=str(root / "cache"), val_samples=2)
    torch.manual_seed(0)
    task = LanguageModel(LlamaConfig(**ARCH, moh=MoHConfig(**BUDGET, router="learned")), lr=1e-3, min_lr=1e-4,
                         warmup_steps=1)
    task.configure_model()
    _sharpen_routers(task.model)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(task, dm)
    trainer.save_checkpoint(root / "learned.ckpt")
    moh(["export-hf", "--checkpoint", str(root / "learned.ckpt"), "--out", str(root / "hf")])

    return root


def _logits(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out


def test_learned_router_folder_loads_in_transformers_with_equal_logits(learned):
    folder = learned / "hf"
    for name in ("config.json", "model.safetensors", "tokenizer_config.json", "hf_moh_llama.py", "README.md"):
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "moh_llama" and config["moh_router"] == "learned"
    assert (config["moh_num_shared_heads"], config["moh_top_k"]) == (BUDGET["num_shared_heads"], BUDGET["top_k"])
    card = (folder / "README.md").read_text()
    assert "learned two-stage router" in card and "Activated heads: 15 of 24 (62.5%)" in card
    assert "| 0 | 8 | 2 | 6 | 3 | 5 |" in card and "learned.ckpt" in card and "trust_remote_code=True" in card

    ours = load_language_model(learned / "learned.ckpt")[0].model
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert loaded.model.layers[0].self_attn.router.type_router.weight.shape == (2, 64)
    assert loaded.model.layers[1].self_attn.router.shared_router is None  # routed-only layer
    idx = torch.randint(3, 259, (2, 24))
    torch.testing.assert_close(_logits(loaded, idx), _logits(ours, idx), atol=1e-5, rtol=1e-5)
    # The routing is not trivial: layer 0's gates vary across tokens and are not all one.
    ours(idx)
    gates = ours.blocks[0].attn.last_gates
    assert (gates > 0).sum(-1).eq(5).all() and gates.std() > 0.1
    prompt = idx[:1, :6]
    assert torch.equal(loaded.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0),
                       ours.generate(prompt, 8, temperature=0))  # transformers' cache vs the suite's KV cache


def test_query_norm_with_per_layer_budgets_exports(tmp_path):
    torch.manual_seed(1)
    model = MoHLlama(LlamaConfig(**ARCH, moh=MoHConfig(num_shared_heads=[4, 2, 8], top_k=[2, 3, 0],
                                                       router="query_norm"))).eval()
    export_hf(model, tmp_path / "qn", ByT5Tokenizer(extra_ids=0), source="a test")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "qn", trust_remote_code=True).eval()
    assert loaded.config.moh_router == "query_norm" and loaded.config.moh_top_k == [2, 3, 0]
    idx = torch.randint(3, 259, (2, 20))
    torch.testing.assert_close(_logits(loaded, idx), _logits(model, idx), atol=1e-5, rtol=1e-5)


def test_lm_eval_hf_model_evaluates_the_learned_export_as_the_checkpoint(learned):
    results = {}
    for flag, value in (("--checkpoint", learned / "learned.ckpt"), ("--hf_folder", learned / "hf")):
        output = learned / f"results{flag}.json"
        moh(["lm-eval", flag, str(value), "--tasks", "[python_basics]", "--include_path", "lm_eval_tasks",
             "--include_defaults", "false", "--batch_size", "2", "--add_bos_token", "false", "--output", str(output)])
        results[flag] = json.loads(output.read_text())
    assert results["--hf_folder"]["config"]["model"] == "hf"  # lm-eval's own transformers model
    accuracy = {flag: result["results"]["python_basics"]["acc,none"] for flag, result in results.items()}
    assert accuracy["--checkpoint"] == accuracy["--hf_folder"]


def test_push_to_hub_uploads_the_written_folder(learned, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, folder_path, repo_id, **kwargs):
        calls.append(("upload_folder", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    moh(["export-hf", "--checkpoint", str(learned / "learned.ckpt"), "--out", str(tmp_path / "push"),
         "--push_to_hub", "someone/tiny-moh", "--private", "true"])
    assert calls[0] == ("create_repo", "someone/tiny-moh", {"repo_type": "model", "private": True, "exist_ok": True})
    assert calls[1][:2] == ("upload_folder", "someone/tiny-moh")
    assert {"config.json", "model.safetensors", "hf_moh_llama.py", "README.md"} <= set(calls[1][2])
    card = (tmp_path / "push" / "README.md").read_text()
    assert 'from_pretrained("someone/tiny-moh", trust_remote_code=True)' in card


@pytest.mark.parametrize("router_dtype", ["float32", "activation"])
def test_exported_query_norm_router_scores_in_the_suites_precision(router_dtype, tmp_path):
    from moh_lightning.layers import QueryNormRouter
    from moh_lightning.models.llama.hf_moh_llama import query_norm_gates

    moh_config = MoHConfig(num_shared_heads=4, top_k=2, router="query_norm", router_dtype=router_dtype)
    export_hf(MoHLlama(LlamaConfig(**ARCH, moh=moh_config)), tmp_path / "qn", ByT5Tokenizer(extra_ids=0), source="t")
    assert json.loads((tmp_path / "qn" / "config.json").read_text())["moh_router_dtype"] == router_dtype
    q = torch.randn(2, 8, 512, 8, generator=torch.Generator().manual_seed(0)).bfloat16()   # bf16 scores tie often
    gates = query_norm_gates(q, 4, 2, router_dtype).float()
    torch.testing.assert_close(gates, QueryNormRouter(8, 4, 2, router_dtype)(None, q=q).gates.float(), rtol=0, atol=0)
    other = query_norm_gates(q, 4, 2, "activation" if router_dtype == "float32" else "float32").float()
    assert (gates != other).any()

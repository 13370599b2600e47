"""`moh export-hf` for every MoH language model: learned router and per-layer budgets out to transformers, lm-eval's
`hf` model and (up to the upload call) the hub."""
from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, ByT5Tokenizer, PreTrainedTokenizerFast

from moh_lightning.cli import main as moh
from moh_lightning.data.text import TextDataModule, TextSource
from moh_lightning.data.tokenizers import encode, exported_tokenizer, load_tokenizer
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.llama import LlamaConfig, MoHLlama, export_hf
from moh_lightning.tasks.checkpoints import load_language_model
from moh_lightning.tasks.language_model import LanguageModel
from moh_lightning.tools.generate import generate

# 3 layers of 8 heads with grouped-query attention and one budget per layer: 2 shared + top-3 of 6 routed, no shared
# + top-2 of 8 (the routed-only router), all 8 shared (shared gates only).
ARCH = {"vocab_size": 259, "depth": 3, "embed_dim": 64, "num_heads": 8, "head_dim": 8, "num_kv_heads": 4,
        "intermediate_size": 96, "block_size": 64}
BUDGET = {"num_shared_heads": [2, 0, 8], "top_k": [3, 2, 0]}
# ASCII, 2- and 3-byte UTF-8, 4-byte emoji with a skin tone and a zero-width joiner, whitespace runs, nothing, and the
# special tokens' spellings, which training read as plain bytes.
TEXTS = ["the cat sat on the mat.", "déjà vu: ü, ß, 日本語", "emoji 🙂👍🏽 👩‍💻", "  two\n\tlines\r\n  ", " ", "",
         "</s><pad> <unk>"]

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
    assert "A plain `tokenizer(text)` gives the ids the model was trained on" in card

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_export_says_what_it_wrote_and_how_to_load_it(learned, tmp_path, capsys):
    """`moh export-hf` once printed only "wrote <folder>"; `convert-hf` and `export-timm` say what and how to load."""
    moh(["export-hf", "--checkpoint", str(learned / "learned.ckpt"), "--out", str(tmp_path / "said")])
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    # 2 shared + top-3 of 8, none shared + top-2 of 8, all 8 shared: (5 + 2 + 8) / 24 heads
    assert printed.startswith(f"wrote {tmp_path / 'said'}: MoHLlama, 62.5% of heads active; load it with ")
    assert f"from_pretrained('{tmp_path / 'said'}', trust_remote_code=True)" in printed
    assert f"moh lm-eval --hf_folder {tmp_path / 'said'}" in printed


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


@pytest.mark.parametrize("moh_config", [MoHConfig(num_shared_heads=4, top_k=2), None], ids=["moh", "dense"])
def test_model_card_snippet_loads_a_byte_tokenizer_that_encodes_as_the_suite(moh_config, tmp_path, monkeypatch):
    """The card's code runs without a question, its tokenizer given the model's config (so no remote code or `moh`
    type is read for it); its plain call gives the suite's ids and its decoding the text back."""
    import tokenizers
    from transformers.models.auto import configuration_auto

    model = MoHLlama(LlamaConfig(**ARCH, moh=moh_config)).eval()
    folder = export_hf(model, tmp_path / "hf", exported_tokenizer("byte"), source="t")
    card = (folder / "README.md").read_text()
    snippet = card.split("```python\n")[1].split("```")[0]
    asked, trusted = [], []
    monkeypatch.setattr("builtins.input", lambda *args: asked.append(args) or "n")
    resolve = configuration_auto.resolve_trust_remote_code  # asked by AutoConfig, which AutoTokenizer runs first

    def record(trust, *args, **kwargs):
        trusted.append(trust)
        return resolve(trust, *args, **kwargs)

    monkeypatch.setattr(configuration_auto, "resolve_trust_remote_code", record)
    scope = {}
    exec(snippet, scope)  # the card's own code: model, tokenizer, greedy generate
    assert not asked and trusted == ([True] if moh_config else [])  # the model; the tokenizer takes its config
    tokenizer, suite = scope["tokenizer"], load_tokenizer("byte")
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == encode(suite, "byte", text)[:-1].tolist(), text
        assert tokenizer.decode(ids) == text and tokenizer.decode([*ids, 1], skip_special_tokens=True) == text
        if "<" not in text:  # plain tokenizers has no split_special_tokens: "</s>" is EOS there
            assert raw.encode(text).ids == ids


@pytest.mark.parametrize("flags", [{"add_bos_token": True, "add_eos_token": True}, {}], ids=["flags", "template"])
def test_exported_hugging_face_tokenizer_adds_no_special_tokens(flags, tmp_path):
    """A LLaMA-style tokenizer (BOS / EOS by flags) and a BERT-style one (by its post-processor) both encode as
    training did once exported."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "mat", "."]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if not flags:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                               special_tokens=[("<s>", 1), ("</s>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            **flags).save_pretrained(tmp_path / "trained")
    name = str(tmp_path / "trained")
    suite = load_tokenizer(name)
    assert suite("the cat")["input_ids"] == [1, 3, 4, 2]  # what a plain call gave before export
    exported_tokenizer(name).save_pretrained(tmp_path / "exported")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "exported")
    for text in ("the cat sat on the mat .", "the dog", ""):
        assert tokenizer(text)["input_ids"] == encode(suite, name, text)[:-1].tolist(), text


def test_a_tokenizer_that_always_adds_eos_does_not_export(tmp_path):
    ByT5Tokenizer(extra_ids=0).save_pretrained(tmp_path / "byt5")
    with pytest.raises(ValueError, match="adds special tokens that cannot be turned off"):
        exported_tokenizer(str(tmp_path / "byt5"))


@pytest.mark.slow
def test_transformers_greedy_generate_continues_as_moh_generate(learned, tmp_path):
    """On the learned export and on a copy made to emit EOS: transformers' greedy ``generate`` from the exported folder
    gives ``moh generate --temperature 0``'s tokens and text, and stops at EOS where it does."""
    prompt, steps = "the cat", 24
    ours = load_language_model(learned / "learned.ckpt")[0].model
    ids = torch.tensor([load_tokenizer("byte")(prompt, add_special_tokens=False)["input_ids"]])
    greedy = ours.generate(ids, 4, temperature=0)
    with torch.no_grad():
        logit = ours(greedy[:, :-1])[0, -1, greedy[0, -1]]
    # EOS's output row a scaled copy of the fourth greedy token's: EOS outscores that token there, if not sooner.
    raw = torch.load(learned / "learned.ckpt", weights_only=False)
    head = raw["state_dict"]["model.lm_head.weight"]
    head[1] = head[greedy[0, -1]] * (1.05 if logit > 0 else 0.95)
    torch.save(raw, tmp_path / "eos.ckpt")
    moh(["export-hf", "--checkpoint", str(tmp_path / "eos.ckpt"), "--out", str(tmp_path / "hf")])

    lengths = []
    for checkpoint, folder in ((learned / "learned.ckpt", learned / "hf"), (tmp_path / "eos.ckpt", tmp_path / "hf")):
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (1, 0)
        out = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=steps, do_sample=False)
        suite = load_language_model(checkpoint)[0].model.generate(ids, steps, temperature=0, eos_id=1)
        assert out.tolist() == suite.tolist()
        lengths.append(out.shape[1] - ids.shape[1])
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        # Bytes that are not UTF-8 (this barely trained model emits many): ByT5 drops them, the ByteLevel decoder
        # writes U+FFFD.
        assert text.replace("\ufffd", "") == generate(str(checkpoint), prompt, max_new_tokens=steps, temperature=0)[0]
    assert lengths[0] == steps and lengths[1] <= 4 and out[0, -1] == 1  # the EOS copy stopped early, both alike

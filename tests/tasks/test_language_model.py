"""MoH-LLaMA decoder, packed text data and the language-model task (CPU, tiny shapes)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import class_of, printed_config
from tiny_models import TINY_LLM_BUDGETS, tiny_llama_config
from transformers import ByT5Tokenizer

from moh_lightning.cli import main as moh
from moh_lightning.data.text import (
    EvenChunks,
    MixtureSequences,
    TextDataModule,
    TextSource,
    tokenize_source,
)
from moh_lightning.data.tokenizers import encode, load_tokenizer
from moh_lightning.layers import activated_head_fraction, pop_load_balance_loss
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.lightning_compat import MoHRichProgressBar
from moh_lightning.models.llama import LlamaConfig, MoHLlama, sample
from moh_lightning.tasks.checkpoints import load_language_model
from moh_lightning.tasks.language_model import LanguageModel, warmup_cosine

CONFIGS = Path(__file__).resolve().parents[2] / "cli_configs"


def tiny(name: str = "tiny_75", **overrides) -> MoHLlama:
    torch.manual_seed(0)
    return MoHLlama(tiny_llama_config(name, **overrides))


@pytest.mark.parametrize("name,params,activated", [
    ("llm_s_100", 186, 1.0), ("llm_s_75", 186, 0.75), ("llm_s_50", 186, 0.5),
    ("llm_b_100", 881, 1.0), ("llm_b_75", 882, 0.75), ("llm_b_50", 882, 0.5),
])
def test_paper_configs_match_table_a(name, params, activated):
    arch = printed_config(["--config", f"{name}.yaml"])["model"]["init_args"]["arch"]  # the shipped config's model
    with torch.device("meta"):
        model = MoHLlama(LlamaConfig(**arch))
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == params
    assert activated_head_fraction(model) == activated == model.config.activated_fraction


@pytest.mark.parametrize("name", TINY_LLM_BUDGETS)
@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_forward_backward_reach_every_parameter(name, num_kv_heads):
    model = tiny(name, num_kv_heads=num_kv_heads).train()
    idx = torch.randint(0, 259, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 259) and torch.isfinite(logits).all()
    # The training loss: with top-1 routing the renormalised routed gate is exactly 1, so the routed router learns
    # from the load-balance loss alone (as in the authors' code), not from the logits.
    loss = logits.logsumexp(-1).mean()
    balance = pop_load_balance_loss(model)
    (loss if balance is None else loss + 0.01 * balance).backward()
    silent = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not silent


def test_decoder_is_causal():
    model = tiny().eval()
    idx = torch.randint(0, 259, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 7) % 259
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[:, :8], model(changed)[:, :8])


@pytest.mark.parametrize("name", ["tiny_75", "tiny_100"])
def test_kv_cache_decoding_matches_full_forward(name):
    model = tiny(name, num_kv_heads=2).eval()
    idx = torch.randint(0, 259, (2, 10))
    with torch.no_grad():
        full = model(idx)
        caches = model.init_kv_caches(2, 10)
        steps = [model(idx[:, :4], caches)] + [model(idx[:, i:i + 1], caches) for i in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_generate_greedy_seeded_and_eos():
    model = tiny().eval()
    prompt = torch.randint(3, 259, (1, 5))
    greedy = model.generate(prompt, 8, temperature=0)
    with torch.no_grad():  # greedy decoding through the cache = argmax of the full forward, token by token
        idx = prompt
        for _ in range(8):
            idx = torch.cat([idx, model(idx)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(greedy, idx)
    assert torch.equal(model.generate(prompt, 8, top_k_tokens=1), greedy)
    a = model.generate(prompt, 8, temperature=1.0, seed=3)
    assert torch.equal(a, model.generate(prompt, 8, temperature=1.0, seed=3))
    eos = int(greedy[0, 5])
    assert model.generate(prompt, 8, temperature=0, eos_id=eos).shape[1] == 6


def test_sample_top_p_keeps_smallest_nucleus():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    drawn = {int(sample(logits, top_p=0.7, generator=torch.Generator().manual_seed(s))) for s in range(200)}
    assert drawn == {0, 1}
    drawn = {int(sample(logits, top_k_tokens=3, generator=torch.Generator().manual_seed(s))) for s in range(200)}
    assert drawn == {0, 1, 2}


def test_block_size_and_budget_errors():
    model = tiny()
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="top_k"):
        LlamaConfig(num_heads=4, moh=MoHConfig(num_shared_heads=2, top_k=3))
    with pytest.raises(ValueError, match=r"^layer_heads=\[\]: give one positive int per attention layer"):
        LlamaConfig(layer_heads=[])
    # Heads of their own number per layer are a pretrained source's (init_from); MoHLlama would not read them.
    with pytest.raises(ValueError, match=r"^model.init_args.arch.layer_heads=\[4, 8\]: only a pretrained source "):
        LanguageModel(LlamaConfig(depth=2, num_heads=4, layer_heads=[4, 8], moh=MoHConfig(num_shared_heads=2)))


@pytest.mark.parametrize("text", ["déf f(x):\n    return x ** 2  # ünïcode", "", "日本 🤗 ok"])
def test_byte_tokenizer_is_byt5s(text):
    byt5, ours = ByT5Tokenizer(extra_ids=0), load_tokenizer("byte")
    ids = encode(ours, "byte", text.encode())
    assert ids.tolist() == byt5(text).input_ids == ours(text)["input_ids"]  # bytes + 3, then EOS
    assert ours(text, add_special_tokens=False)["input_ids"] == byt5(text, add_special_tokens=False)["input_ids"]
    assert len(ours) == len(byt5) and (ours.eos_token_id, ours.pad_token_id) == (byt5.eos_token_id, byt5.pad_token_id)
    cut = [0, *ids.tolist()[:-2], 1, 5, 2]  # pad, a character cut in two, eos, unk
    for skip in (True, False):
        assert ours.decode(cut, skip_special_tokens=skip) == byt5.decode(cut, skip_special_tokens=skip)


def _corpus(root: Path, name: str, words: str, files: int = 30) -> Path:
    folder = root / name
    folder.mkdir()
    for i in range(files):
        (folder / f"{i}.txt").write_text(f"{words} {i}\n" * 20)
    return folder


def test_tokenised_once_split_by_file_and_windows(tmp_path):
    source = TextSource(path=str(_corpus(tmp_path, "a", "alpha beta")), val_fraction=0.2)
    folder = tokenize_source(source, "byte", tmp_path / "cache")
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["documents"]["train"] + meta["documents"]["val"] == 30 and meta["documents"]["val"] > 0
    stamp = (folder / "train.bin").stat().st_mtime_ns
    assert tokenize_source(source, "byte", tmp_path / "cache") == folder
    assert (folder / "train.bin").stat().st_mtime_ns == stamp  # not re-tokenised

    tokens = np.memmap(folder / "train.bin", dtype=np.uint16, mode="r")
    data = MixtureSequences([tokens], [1.0], seq_len=16, num_samples=50)
    item = data[7]["tokens"]
    start = int(data.chunk[7]) * 16
    assert item.shape == (17,) and item.tolist() == tokens[start:start + 17].tolist()
    assert len(set(data.chunk.tolist())) == min(50, (len(tokens) - 1) // 16)  # no chunk repeats early
    val = EvenChunks([tokens], seq_len=16, max_samples=5)
    assert len(val) == 5


def test_mixture_follows_weights_and_reads_datasets(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"text": f"gamma delta {i} " * 30}) for i in range(60)))
    sources = [TextSource(path=str(_corpus(tmp_path, "a", "alpha beta")), weight=3.0),
               TextSource(dataset="json", data_files=str(rows), streaming=True, weight=1.0, val_fraction=0.1)]
    dm = TextDataModule(sources=sources, seq_len=16, batch_size=4, cache_dir=str(tmp_path / "cache"),
                        samples_per_epoch=4000)
    dm.prepare_data()
    dm.setup("fit")
    assert abs((dm.train_set.source == 0).mean() - 0.75) < 0.03
    batch = next(iter(dm.train_dataloader()))
    assert batch["tokens"].shape == (4, 17) and batch["source"].shape == (4,)
    text = load_tokenizer("byte").decode(dm.train_set[int(np.flatnonzero(dm.train_set.source == 1)[0])]["tokens"])
    assert "gamma" in text or "delta" in text
    assert dm.vocab_size == 259 and dm.is_byte_level


def test_data_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="exactly one of path"):
        TextSource()
    with pytest.raises(FileNotFoundError, match="no such file"):
        tokenize_source(TextSource(path=str(tmp_path / "missing")), "byte", tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": "x"}))
    with pytest.raises(KeyError, match="text_field"):
        tokenize_source(TextSource(dataset="json", data_files=str(rows)), "byte", tmp_path)


def test_warmup_cosine_schedule():
    at = warmup_cosine(lr=1e-3, min_lr=1e-4, init_lr=1e-7, warmup_steps=10, total_steps=110)
    assert at(0) == pytest.approx(1e-7) and at(10) == pytest.approx(1e-3)
    assert at(60) == pytest.approx(5.5e-4) and at(110) == pytest.approx(1e-4) and at(500) == pytest.approx(1e-4)


def _fit(tmp_path: Path, max_tokens: int, max_steps: int = -1, **task_kwargs):
    dm = TextDataModule(sources=[TextSource(path=str(_corpus(tmp_path, "c", "def f(x): return x")),
                                            val_fraction=0.2)],
                        seq_len=16, batch_size=4, cache_dir=str(tmp_path / "cache"), val_samples=8)
    task = LanguageModel(tiny_llama_config("tiny_75"), warmup_steps=2, max_tokens=max_tokens, lr=3e-3, min_lr=3e-4,
                         **task_kwargs)
    trainer = L.Trainer(max_steps=max_steps, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                        num_sanity_val_steps=0, val_check_interval=4, check_val_every_n_epoch=None,
                        gradient_clip_val=1.0)
    trainer.fit(task, dm)
    return trainer, task, dm


@pytest.mark.slow
def test_token_budget_stops_training_and_loss_falls(tmp_path):
    trainer, task, dm = _fit(tmp_path, max_tokens=16 * 4 * 2 * 12)  # 12 optimizer steps of 2 micro-batches
    assert trainer.global_step == 12 == task.total_steps()
    assert task.tokens_seen == 16 * 4 * 2 * 12
    metrics = trainer.callback_metrics
    assert {"train/loss", "train/ppl", "train/load_balance_loss", "val/loss", "val/bpb"} <= set(metrics)
    assert metrics["val/bpb"] == pytest.approx(metrics["val/loss"] / math.log(2))
    assert metrics["val/loss"] < math.log(259) - 1.0  # far below the uniform guess
    assert task.head_load_groups({"source": torch.tensor([0, 0])}).tolist() == [0, 0]


@pytest.mark.slow
def test_progress_bar_counts_the_token_budget(tmp_path):
    """The bar counts the run's steps against the budget's, across epochs; with the configs' max_epochs -1 Lightning's
    Rich bar showed the batches of each epoch, labelled "Epoch 0/-2"."""
    shown = set()

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            bar = trainer.progress_bar_callback
            row = bar.progress.tasks[bar.train_progress_bar_id]
            shown.add((row.description.strip(), row.completed, row.total))
            assert "v_num" not in bar.get_metrics(trainer, trainer.lightning_module)

    dm = TextDataModule(sources=[TextSource(path=str(_corpus(tmp_path, "c", "def f(x): return x")))], seq_len=16,
                        batch_size=4, cache_dir=str(tmp_path / "cache"))
    task = LanguageModel(tiny_llama_config("tiny_75"), warmup_steps=2, max_tokens=16 * 4 * 5)  # 5 steps
    trainer = L.Trainer(max_epochs=-1, limit_train_batches=3, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[MoHRichProgressBar(), Look()])
    trainer.fit(task, dm)
    assert trainer.global_step == 5 and trainer.max_steps == 5
    assert sorted(shown) == [("Epoch 0, step", step, 5) for step in (1, 2, 3)] + [("Epoch 1, step", 4, 5),
                                                                                 ("Epoch 1, step", 5, 5)]

def test_checkpoint_reload_and_generate_tool(tmp_path, capsys):
    trainer, task, dm = _fit(tmp_path, max_tokens=10 ** 9, max_steps=4)
    path = tmp_path / "lm.ckpt"
    trainer.save_checkpoint(path)
    loaded, data_hparams = load_language_model(path)
    assert data_hparams["tokenizer"] == "byte" and loaded.tokens_seen == task.tokens_seen
    batch = next(iter(dm.val_dataloader()))
    task.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded._loss(batch), task._loss(batch))
    moh(["generate", "--checkpoint", str(path), "--prompt", "def f", "--max_new_tokens", "12",
         "--temperature", "0"])
    out = capsys.readouterr().out
    assert out.startswith("def f") and len(out.splitlines()[0]) > len("def f")


def test_task_rejects_bad_beta_and_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="load_balance_beta"):
        LanguageModel(tiny_llama_config("tiny_75"), load_balance_beta=-1)
    dm = TextDataModule(sources=[TextSource(path=str(_corpus(tmp_path, "c", "x = 1")), val_fraction=0.2)],
                        seq_len=16, cache_dir=str(tmp_path / "cache"))
    small_vocab = LanguageModel(tiny_llama_config("tiny_75", vocab_size=100))
    with pytest.raises(ValueError, match="vocab_size"):
        L.Trainer(fast_dev_run=1, logger=False).fit(small_vocab, dm)


@pytest.mark.slow
def test_the_embedded_llm_default_reads_the_standard_library_split_by_file(tmp_path):
    """On the real corpus (the other budgets of this recipe differ only in their heads: tests/cli/test_configs.py)."""
    stdlib_cache = tmp_path / "cache"
    moh(["fit", "--config", "llm_stdlib_75.yaml", "--trainer.fast_dev_run=1", f"--trainer.default_root_dir={tmp_path}",
         f"--trainer.logger.init_args.save_dir={tmp_path}", f"--data.cache_dir={stdlib_cache}",
         "--data.batch_size=2", "--data.val_samples=2"])
    (folder,) = stdlib_cache.iterdir()
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["documents"]["train"] > 500 and meta["documents"]["val"] > 5  # the stdlib, split by file


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("llm_[sb]_*.yaml"))
                         + ["llama3_8b_moh_75.yaml"])
def test_paper_configs_parse(config):
    assert class_of(printed_config(["--config", config])["model"]["class_path"]) is LanguageModel

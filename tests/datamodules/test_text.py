"""Text: a source split by a held-out block of its tokens; a single text file trains as it is."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from moh_lightning.cli import main as moh
from moh_lightning.data.text import TextDataModule, TextSource, tokenize_source

CORPUS = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400))


def _tokens(folder, split):
    meta = json.loads((folder / "meta.json").read_text())
    return np.fromfile(folder / f"{split}.bin", dtype=meta["dtype"]), meta


def test_single_file_splits_by_tokens_by_default(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    folder = tokenize_source(TextSource(path=str(corpus), val_fraction=0.1), "byte", tmp_path / "cache")
    train, meta = _tokens(folder, "train")
    val, _ = _tokens(folder, "val")
    assert meta["split_by"] == "tokens" and sum(meta["documents"].values()) == 1
    whole = np.frombuffer(CORPUS.encode(), dtype=np.uint8).astype(np.int64) + 3
    # train then validation is the document (plus its EOS) in order: one contiguous held-out block at the end
    assert np.concatenate([train, val]).tolist() == [*whole.tolist(), 1]
    assert len(val) == int(np.ceil((len(whole) + 1) * 0.1))


def test_a_source_saved_under_its_name_before_the_split_still_loads(tmp_path, monkeypatch):
    source = TextSource(path="corpus.txt", weight=2.0)
    monkeypatch.setattr(TextSource, "__module__", "moh_lightning.data.text")  # where checkpoints before it name it
    torch.save({"sources": [source]}, tmp_path / "old.ckpt")
    monkeypatch.undo()
    assert torch.load(tmp_path / "old.ckpt", weights_only=True)["sources"] == [source]


def test_split_rules(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(40):
        (folder / f"{i}.txt").write_text(f"document {i} " * 20)
    by_docs = tokenize_source(TextSource(path=str(folder), val_fraction=0.2), "byte", tmp_path / "c")
    assert json.loads((by_docs / "meta.json").read_text())["split_by"] == "documents"
    by_tokens = tokenize_source(TextSource(path=str(folder), val_fraction=0.2), "byte", tmp_path / "c",
                                split_by="tokens")
    assert by_tokens != by_docs
    train, meta = _tokens(by_tokens, "train")
    val, _ = _tokens(by_tokens, "val")
    assert meta["split_by"] == "tokens" and abs(len(val) / (len(train) + len(val)) - 0.2) < 0.01
    with pytest.raises(ValueError, match="split_by"):
        TextDataModule(split_by="lines")
    assert TextDataModule().hparams.split_by == "auto" and TextDataModule(split_by="tokens").hparams.split_by


def test_hugging_face_tokenizer_splits_by_tokens(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(CORPUS.replace(":", " ").replace(".", " ").split())) + ["<eos>", "<unk>"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    tokenizer.save_pretrained(tmp_path / "tok")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    dm = TextDataModule(sources=[TextSource(path=str(corpus), val_fraction=0.1)], tokenizer=str(tmp_path / "tok"),
                        seq_len=16, batch_size=2, cache_dir=str(tmp_path / "cache"), val_samples=4)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.val_set) == 4 and len(dm.train_set) > 50
    assert dm.vocab_size == len(words)


@pytest.mark.slow
def test_single_file_trains_with_nothing_else(run_dir):
    (run_dir / "corpus.txt").write_text(CORPUS)
    moh(["fit", "--config", "llm_stdlib_75.yaml", "--data.init_args.sources", "[{path: corpus.txt}]",
         "--trainer.fast_dev_run=1", f"--data.cache_dir={run_dir / 'cache'}", "--data.batch_size=2",
         "--data.val_samples=2"])
    (folder,) = (run_dir / "cache").iterdir()
    assert json.loads((folder / "meta.json").read_text())["split_by"] == "tokens"

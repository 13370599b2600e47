"""Caches that cannot serve the wrong data: another folder's file of the same name, an edited file, two builders."""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerFast

from moh_lightning.data.cache import FINGERPRINT
from moh_lightning.data.text import TextDataModule, TextSource, tokenize_source
from moh_lightning.metrics.fidelity import reference_cache_name

SHAKESPEARE = "BUTIO:\nTherefore that she royard me, and my lord.\n" * 300
PYTHON = "def parse(line):\n    return line.split(',')\n" * 300


def _byte_tokens(text: str) -> list[int]:
    return [*(np.frombuffer(text.encode(), dtype=np.uint8).astype(int) + 3).tolist(), 1]


def _all_tokens(folder: Path) -> list[int]:
    """A single file's tokens: split by tokens, train then validation is the document and its EOS, in order."""
    dtype = json.loads((folder / "meta.json").read_text())["dtype"]
    return np.concatenate([np.fromfile(folder / f"{s}.bin", dtype=dtype) for s in ("train", "val")]).tolist()


def _train(project: Path, monkeypatch) -> TextDataModule:
    """The own-data page's text run in ``project``: a relative ``corpus.txt`` and the default cache under HOME."""
    monkeypatch.chdir(project)
    data = TextDataModule(sources=[TextSource(path="corpus.txt")], seq_len=32, batch_size=2, val_samples=2)
    data.prepare_data()
    data.setup("fit")
    return data


def test_same_file_name_in_two_folders_trains_on_each_own_text(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    shakespeare, own = tmp_path / "shakespeare", tmp_path / "own"
    for folder, text in ((shakespeare, SHAKESPEARE), (own, PYTHON)):
        folder.mkdir()
        (folder / "corpus.txt").write_text(text)
    first = _train(shakespeare, monkeypatch)
    with caplog.at_level(logging.INFO):
        second = _train(own, monkeypatch)
    assert _all_tokens(second._folders[0]) == _byte_tokens(PYTHON)  # not the Shakespeare tokens cached first
    assert _all_tokens(first._folders[0]) == _byte_tokens(SHAKESPEARE)
    window = second.train_set[0]["tokens"].numpy()
    assert bytes((window[window > 2] - 3).astype(np.uint8).tolist()).decode() in PYTHON * 2
    assert first._folders[0].parent == second._folders[0].parent == tmp_path / "home/.cache/moh_lightning/text"
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("moh: data")][-1]
    assert str(own / "corpus.txt") in line and f"{len(PYTHON.encode()):,} bytes" in line
    assert str(second._folders[0]) in line


def test_the_data_line_names_an_absolute_path_once(tmp_path):
    from moh_lightning.data.token_arrays import describe

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PYTHON)
    relative = describe(TextSource(path="corpus.txt"), tokenize_source(TextSource(path=str(corpus)), "byte", tmp_path))
    assert relative.startswith(f"moh: data corpus.txt ({corpus}, {len(PYTHON.encode()):,} bytes)")
    absolute = TextSource(path=str(corpus))  # as a resumed run reads it from its config.yaml
    line = describe(absolute, tokenize_source(absolute, "byte", tmp_path))
    assert line.startswith(f"moh: data {corpus} ({len(PYTHON.encode()):,} bytes)")


def test_edited_file_is_tokenised_again(tmp_path, caplog):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SHAKESPEARE)
    source = TextSource(path=str(corpus))
    folder = tokenize_source(source, "byte", tmp_path / "cache")
    stat = corpus.stat()
    edited = SHAKESPEARE.replace("lord", "king")  # same size, and the old times put back: only the bytes differ
    corpus.write_text(edited)
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with caplog.at_level(logging.INFO):
        assert tokenize_source(source, "byte", tmp_path / "cache") == folder
    assert _all_tokens(folder) == _byte_tokens(edited)
    assert any("changed since it was tokenised" in r.getMessage() for r in caplog.records)
    corpus.write_text(PYTHON)
    assert _all_tokens(tokenize_source(source, "byte", tmp_path / "cache")) == _byte_tokens(PYTHON)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name]  # replaced, no leftovers


def test_touched_file_is_not_tokenised_again(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PYTHON)
    source = TextSource(path=str(corpus))
    folder = tokenize_source(source, "byte", tmp_path / "cache")
    stamp = (folder / "train.bin").stat().st_mtime_ns
    os.utime(corpus)  # same bytes, new time (a git checkout, a copy)
    assert tokenize_source(source, "byte", tmp_path / "cache") == folder
    assert (folder / "train.bin").stat().st_mtime_ns == stamp
    record = json.loads((folder / FINGERPRINT).read_text())
    assert record["files"][0][2] == corpus.stat().st_mtime_ns  # the new time is recorded: the next check is quick


def _retrained_tokenizer(folder: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate([*words, "<eos>", "<unk>"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)


def test_tokenizer_retrained_in_place_is_another_entry(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PYTHON)
    words = sorted(set(PYTHON.replace("(", " ").replace(")", " ").replace(",", " ").split()))
    _retrained_tokenizer(tmp_path / "tok", words)
    first = tokenize_source(TextSource(path=str(corpus)), str(tmp_path / "tok"), tmp_path / "cache")
    _retrained_tokenizer(tmp_path / "tok", words[::-1])  # same path and size, other ids
    second = tokenize_source(TextSource(path=str(corpus)), str(tmp_path / "tok"), tmp_path / "cache")
    assert first != second and _all_tokens(first) != _all_tokens(second)


def _build_at_the_same_time(corpus: str, cache: str, barrier) -> None:
    import moh_lightning.data.token_arrays as token_arrays

    encode = token_arrays.encode

    def in_step(*args):  # both processes are inside their build before either publishes it
        barrier.wait(timeout=60)
        token_arrays.encode = encode
        return encode(*args)

    token_arrays.encode = in_step
    token_arrays.tokenize_source(token_arrays.TextSource(path=corpus), "byte", Path(cache))


def test_two_processes_building_one_entry_leave_a_valid_cache(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PYTHON)
    # Forked, not spawned: two fresh interpreters importing torch took 20 s; the race is the same in either.
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    workers = [context.Process(target=_build_at_the_same_time, args=(str(corpus), str(tmp_path / "cache"), barrier))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]
    (entry,) = (tmp_path / "cache").iterdir()  # one entry, no temporary folder left behind
    assert _all_tokens(entry) == _byte_tokens(PYTHON)
    assert tokenize_source(TextSource(path=str(corpus)), "byte", tmp_path / "cache") == entry


def test_latents_of_two_folders_of_one_name_and_an_edited_image(tmp_path):
    from diffusers import AutoencoderKL
    from PIL import Image

    from moh_lightning.data.latents import LatentDataModule

    vae = tmp_path / "vae"
    AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                  up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=4,
                  sample_size=8).save_pretrained(vae)
    rng = np.random.default_rng(0)
    entries = []
    for project in ("a", "b"):
        for label in ("cat", "dog"):
            (tmp_path / project / "images" / label).mkdir(parents=True)
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(
                tmp_path / project / "images" / label / "0.png")
        data = LatentDataModule(str(tmp_path / project / "images"), cache_dir=str(tmp_path / "cache"), vae=str(vae),
                                image_size=8, batch_size=2, num_workers=0)
        data.prepare_data()
        entries.append(data._entry)
    assert entries[0] != entries[1]
    first = np.load(entries[1] / "latents.npy").copy()
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "b/images/cat/0.png")
    data.prepare_data()
    assert data._entry == entries[1] and not np.array_equal(np.load(entries[1] / "latents.npy"), first)


def test_fid_reference_cache_names_differ_by_folder_and_content(tmp_path):
    for project in ("a", "b"):
        (tmp_path / project).mkdir()
        np.savez(tmp_path / project / "ref.npz", np.zeros((2, 4, 4, 3), dtype=np.uint8))
    a, b = (reference_cache_name(str(tmp_path / p / "ref.npz")) for p in ("a", "b"))
    assert a != b and a.startswith("ref-")
    np.savez(tmp_path / "a" / "ref.npz", np.ones((3, 4, 4, 3), dtype=np.uint8))
    assert reference_cache_name(str(tmp_path / "a" / "ref.npz")) != a


def test_edited_local_dataset_rows_are_tokenised_again(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": SHAKESPEARE}))
    source = TextSource(dataset="json", data_files=str(rows), streaming=False)
    folder = tokenize_source(source, "byte", tmp_path / "cache")
    assert _all_tokens(folder) == _byte_tokens(SHAKESPEARE)
    rows.write_text(json.dumps({"text": PYTHON}))
    assert _all_tokens(tokenize_source(source, "byte", tmp_path / "cache")) == _byte_tokens(PYTHON)

"""Bad input to the LM task: a one-line error that names the file or key and what to do, raised before training."""
from pathlib import Path

import pytest

from moh_lightning.cli import main
from moh_lightning.data.text import TextDataModule, TextSource
from moh_lightning.data.tokenizers import load_tokenizer


def _data(tmp_path: Path, *sources: TextSource, **kwargs) -> TextDataModule:
    data = TextDataModule(list(sources), seq_len=kwargs.pop("seq_len", 64), batch_size=2,
                          cache_dir=str(tmp_path / "cache"), **kwargs)
    data.prepare_data()
    data.setup("fit")
    return data


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_corpus_folder_with_no_matching_files(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "notes.md").write_text("text, but not *.txt")
    with pytest.raises(FileNotFoundError) as error:
        _data(tmp_path, TextSource(path=str(tmp_path / "corpus")))
    assert f"'{tmp_path / 'corpus'}': no files match pattern '*.txt'" in _one_line(error)
    assert "set the source's pattern" in str(error.value)


def test_corpus_path_that_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        _data(tmp_path, TextSource(path=str(tmp_path / "missing")))
    assert f"'{tmp_path / 'missing'}': no such file or folder" in _one_line(error)


def test_corpus_of_empty_files(tmp_path):
    (tmp_path / "corpus").mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / "corpus" / name).write_text("")
    with pytest.raises(ValueError) as error:
        _data(tmp_path, TextSource(path=str(tmp_path / "corpus")))
    assert f"'{tmp_path / 'corpus'}': its 3 documents are empty; give it some text" in _one_line(error)
    assert not list((tmp_path / "cache").rglob("meta.json"))  # nothing cached that a later run would trust


def test_training_text_shorter_than_one_sequence(tmp_path):
    long, short = tmp_path / "long.txt", tmp_path / "short.txt"
    long.write_text("x = 1\n" * 100)
    short.write_text("print('hi')\n")
    with pytest.raises(ValueError) as error:
        _data(tmp_path, TextSource(path=str(long), val_fraction=0.0), TextSource(path=str(short), val_fraction=0.0))
    message = _one_line(error)
    assert f"'{short}': its training split has 13 tokens, fewer than one sequence" in message
    assert "one sequence of data.init_args.seq_len + 1 = 65 (documents: 1 train, 0 validation" in message
    assert "lower seq_len" in message


def test_validation_text_shorter_than_one_sequence(tmp_path):
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"{i}.txt").write_text("x = 1\n" * 50)
    with pytest.raises(ValueError) as error:
        _data(tmp_path, TextSource(path=str(tmp_path / "corpus"), val_fraction=0.0))
    message = _one_line(error)
    assert "no validation sequence of data.init_args.seq_len + 1 = 65 tokens" in message
    assert "holds out 0 tokens (documents: 3 train, 0 validation at val_fraction=0.0)" in message
    assert "raise a source's val_fraction" in message


@pytest.mark.parametrize("name, expected", [
    ("/nonexistent/tokenizer", "data.init_args.tokenizer='/nonexistent/tokenizer': no such folder"),
    ("no-such-org/no-such-tokenizer", "data.init_args.tokenizer='no-such-org/no-such-tokenizer': cannot load it"),
    ("empty folder", "cannot load it (Couldn't instantiate the backend tokenizer"),
])
def test_tokenizer_that_cannot_be_found(name, expected, tmp_path):
    # Offline (conftest sets HF_HUB_OFFLINE), as on a cluster node: the hub id is in no cache and unreachable.
    if name == "empty folder":
        name = str(tmp_path / "tokenizer")
        Path(name).mkdir()
    (tmp_path / "doc.txt").write_text("x = 1\n" * 100)
    with pytest.raises(OSError) as error:
        _data(tmp_path, TextSource(path=str(tmp_path / "doc.txt")), tokenizer=name)
    assert expected in _one_line(error)
    assert "or 'byte'" in str(error.value)
    with pytest.raises(OSError, match=r"^--tokenizer="):
        load_tokenizer(name, key="--tokenizer")


def test_bad_corpus_stops_moh_fit_at_setup(tmp_path, run_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="^moh: data source path .*no files match pattern"):  # one line
        main(["fit", "--config", "llm_stdlib_75.yaml", f"--data.init_args.sources=[{{path: {tmp_path / 'empty'}}}]",
              f"--data.init_args.cache_dir={tmp_path / 'cache'}", "--data.init_args.num_workers=2"])
    # stopped before any training step: no checkpoint in any of the run's folders
    assert not list((run_dir / "runs" / "llm_stdlib_75").glob("version_*/checkpoints/*.ckpt"))

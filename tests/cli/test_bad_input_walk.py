"""Every `moh` command, given what a user gets wrong (a missing file, another task's checkpoint, a family it cannot
convert, a learning rate of 0), stops in one line with a non-zero exit and leaves nothing behind (issue 40)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hf_families import train_tokenizer

from moh_lightning.cli import main
from moh_lightning.tasks.checkpoints import write_checkpoint
from moh_lightning.tasks.classification import ImageClassifier

LOCAL_TASKS = ["--include_path", "lm_eval_tasks", "--include_defaults", "false", "--tasks", "[python_basics]"]


def _one_line(args: list[str], folder) -> str:
    """The message `moh <args>` stops with, after checking it is one line, the exit non-zero and ``folder`` (the
    working folder) as it was."""
    before = sorted(path.relative_to(folder) for path in folder.rglob("*"))
    with pytest.raises(SystemExit) as stop:
        main(args)
    message = str(stop.value.code)
    assert stop.value.code not in (0, None) and "\n" not in message and message.startswith("moh"), message
    assert sorted(path.relative_to(folder) for path in folder.rglob("*")) == before  # no run or eval folder
    return message


@pytest.mark.parametrize("args", [
    ["generate", "--checkpoint", "nope.ckpt"],
    ["export-hf", "--checkpoint", "nope.ckpt", "--out", "out"],
    ["export-timm", "--checkpoint", "nope.ckpt", "--out", "out"],
    ["lm-eval", "--checkpoint", "nope.ckpt", *LOCAL_TASKS],
    ["lm-eval", "--hf_folder", "nope", *LOCAL_TASKS],
    ["convert-llama", "--source", "./nope", "--out", "out"],
    ["validate", "--config", "vit_tiny_mnist_75.yaml", "--ckpt_path", "nope.ckpt"],
    ["fit", "--config", "llm_stdlib_75.yaml", "--ckpt_path", "nope.ckpt"],
], ids=lambda args: args[0])
@pytest.mark.slow
def test_a_missing_file_is_one_line_naming_it(args, run_dir):
    message = _one_line(args, run_dir)
    assert "nope" in message and ("no such file" in message or "no config.json" in message or "cannot load" in message)


def test_a_learning_rate_of_0_is_refused_naming_the_key(run_dir):
    message = _one_line(["fit", "--config", "llm_stdlib_75.yaml", "--model.init_args.lr", "0",
                         "--model.init_args.min_lr", "0"], run_dir)
    assert "model.init_args.lr=0.0 must be > 0" in message and "moh validate" in message


def test_another_tasks_checkpoint_is_one_line_naming_both_tasks(run_dir):
    write_checkpoint(run_dir / "vit.ckpt", ImageClassifier, {"arch": {}}, {"model.head.weight": torch.zeros(2, 2)}, {})
    message = _one_line(["validate", "--config", "llm_stdlib_75.yaml", "--ckpt_path", "vit.ckpt"], run_dir)
    assert "written by the task ImageClassifier" in message and "builds a LanguageModel" in message
    message = _one_line(["generate", "--checkpoint", "vit.ckpt"], run_dir)
    assert "ImageClassifier checkpoint" in message and "moh export-timm" in message


@pytest.mark.slow
def test_a_family_that_cannot_take_moh_stops_fit_as_it_stops_convert_hf(run_dir):
    import transformers

    folder = run_dir / "bloom"
    tokenizer = train_tokenizer(folder)
    transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_layer=1,
                                                           n_head=4)).save_pretrained(folder)
    (run_dir / "my.txt").write_text("def f(x):\n    return x\n" * 50)
    converted = _one_line(["convert-hf", "--source", str(folder), "--out", "out"], run_dir)
    fitted = _one_line(["fit", "--config", "continue_hf_75.yaml", "--model.init_args.init_from", str(folder),
                        "--data.init_args.tokenizer", str(folder), "--data.init_args.sources", "[{path: my.txt}]"],
                       run_dir)
    reason = "BloomForCausalLM: its attention does not go through transformers' attention interface"
    assert reason in converted and converted.partition(reason)[2] == fitted.partition(reason)[2]


@pytest.mark.slow
def test_the_command_itself_prints_one_line_and_no_traceback_and_leaves_no_empty_inductor_folder(tmp_path):
    """Run as a user runs it, in a process of its own. Importing Lightning makes torch's
    `$TMPDIR/torchinductor_<user>` even where nothing is compiled; the command removes it again."""
    work, tmpdir = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmpdir.mkdir()
    # Without TORCHINDUCTOR_CACHE_DIR, which torch sets in this process once it has imported Inductor (a user's shell
    # has none): the child would make its folder there and never in $TMPDIR.
    env = {**{key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_CACHE_DIR"},
           "TMPDIR": str(tmpdir)}
    done = subprocess.run([sys.executable, "-c", "from moh_lightning.cli import main; main()", "validate",
                           "--config", "vit_tiny_mnist_75.yaml", "--ckpt_path", "nope.ckpt"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["moh validate: --ckpt_path nope.ckpt: no such file; give a .ckpt "
                                                "written by `moh fit` (or `last`, this run name's newest)."]
    assert not list(work.iterdir())
    assert not list(tmpdir.iterdir())

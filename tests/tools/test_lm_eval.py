"""lm-evaluation-harness on MoH checkpoints: the shipped example task and a local generation task, no hub access;
tasks that cannot be had stop in one line, and the harness's notes a user can do nothing about stay silent."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval_tasks import EXAMPLE_TASK, QUESTIONS, write_generation_task
from tiny_models import tiny_llama_config

from moh_lightning.cli import main as moh
from moh_lightning.cli import quiet_third_party
from moh_lightning.data.text import TextDataModule, TextSource
from moh_lightning.tasks.language_model import LanguageModel
from moh_lightning.tools.lm_eval import MoHLM


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A briefly trained tiny query-norm MoH checkpoint, its transformers export, and a local generation task."""
    root = tmp_path_factory.mktemp("lm_eval")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"{i}.txt").write_text("the cat sat on the mat. the dog sat on the mat.\n" * 10)
    dm = TextDataModule(sources=[TextSource(path=str(corpus), val_fraction=0.2)], seq_len=32, batch_size=4,
                        cache_dir=str(root / "cache"), val_samples=4)
    torch.manual_seed(0)
    task = LanguageModel(tiny_llama_config("tiny_75", router="query_norm"), lr=3e-3, min_lr=3e-4, warmup_steps=2)
    trainer = L.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(task, dm)
    trainer.save_checkpoint(root / "tiny.ckpt")
    moh(["export-hf", "--checkpoint", str(root / "tiny.ckpt"), "--out", str(root / "hf")])

    write_generation_task(root)
    return root


@pytest.mark.slow
def test_harness_loglikelihood_is_the_models(workspace):
    lm = MoHLM(checkpoint=str(workspace / "tiny.ckpt"), batch_size=2)
    requests = [Instance("loglikelihood", {}, (q["question"], c), i)
                for i, (q, c) in enumerate((q, c) for q in QUESTIONS for c in q["choices"])]
    scores = [logprob for logprob, _ in lm.loglikelihood(requests)]
    for request, score in zip(requests, scores, strict=True):
        context, continuation = request.arguments
        ids = torch.tensor([lm.tokenizer(context + continuation, add_special_tokens=False)["input_ids"]])
        cont_len = len(continuation.encode())  # byte-level: one token per byte
        with torch.no_grad():
            logprobs = lm.net(ids[:, :-1]).log_softmax(-1)[0, -cont_len:]
        expected = logprobs.gather(-1, ids[0, -cont_len:, None]).sum().item()
        assert score == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow
def test_lm_eval_tool_on_local_tasks_checkpoint_and_export_agree(workspace, capsys):
    results = {}
    for flag, value in (("--checkpoint", workspace / "tiny.ckpt"), ("--hf_folder", workspace / "hf")):
        output = workspace / f"results{flag}.json"
        moh(["lm-eval", flag, str(value), "--tasks", f"[{EXAMPLE_TASK}, tiny_gen]", "--include_path",
             str(workspace / "tasks"), "--include_defaults", "false", "--batch_size", "2",
             "--output", str(output)])  # no BOS flag: one policy for both (the tokenizer the export writes)
        results[flag] = json.loads(output.read_text())["results"]
    assert "python_basics" in capsys.readouterr().out
    ours, exported = results["--checkpoint"], results["--hf_folder"]
    assert 0.0 <= ours["python_basics"]["acc,none"] <= 1.0
    assert ours["python_basics"]["acc,none"] == exported["python_basics"]["acc,none"]
    assert ours["tiny_gen"]["exact_match,none"] == exported["tiny_gen"]["exact_match,none"]


def test_lm_eval_tool_needs_one_model():
    with pytest.raises(SystemExit, match="^moh lm-eval: give exactly one of --checkpoint"):  # one line, no traceback
        moh(["lm-eval", "--tasks", "[tiny_choice]"])


@pytest.mark.slow
def test_the_shipped_example_runs_by_name_from_any_folder_without_the_harness_notes(workspace, run_dir, capfd,
                                                                                    caplog):
    """From an empty folder outside any git repository: the example's data is read beside its YAML, and neither
    lm-eval's note on the built network nor git's "fatal: not a git repository" reaches the terminal."""
    moh(["lm-eval", "--checkpoint", str(workspace / "tiny.ckpt"), "--include_path", "lm_eval_tasks",
         "--include_defaults", "false", "--tasks", "[python_basics]", "--output", "results.json"])
    results = json.loads((run_dir / "results.json").read_text())["results"]["python_basics"]
    assert 0.0 <= results["acc,none"] <= 1.0 and results["acc_norm,none"] >= 0.0
    out, err = capfd.readouterr()  # git's stderr included, which goes to the file descriptor
    assert "python_basics" in out
    assert out.strip().splitlines()[-1] == "moh lm-eval: results in results.json"  # where it wrote, said
    for note in ("`pretrained` model kwarg", "already-initialized model", "Custom kwargs", "fatal:"):
        assert note not in out + err + caplog.text, note


def test_only_the_named_harness_notes_are_silenced(caplog):
    quiet_third_party()
    model, task = logging.getLogger("lm_eval.models.huggingface"), logging.getLogger("lm_eval.api.task")
    model.warning("`pretrained` model kwarg is not of type `str`. Many other model arguments may be ignored.")
    model.warning("Passed an already-initialized model through `pretrained`, assuming single-process call")
    task.warning("python_basics: Custom kwargs can be passed to `--metadata` in console (as json string)")
    model.warning("another note of the harness")
    model.warning("a note that mentions `pretrained` model kwarg is not of type `str` later")
    assert [record.getMessage() for record in caplog.records] == [
        "another note of the harness", "a note that mentions `pretrained` model kwarg is not of type `str` later"]

def _error(args: list[str], checkpoint: Path) -> str:
    with pytest.raises(SystemExit) as exit_info:
        moh(["lm-eval", "--checkpoint", str(checkpoint), *args])
    message = str(exit_info.value.code)
    assert "\n" not in message, message
    return message


def test_a_checkpoint_that_does_not_load_stops_the_tool_before_any_task_touches_a_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    message = _error(["--include_path", "lm_eval_tasks", "--include_defaults", "false", "--tasks", "[python_basics]"],
                     tmp_path / "never_written.ckpt")
    assert "never_written.ckpt" in message and not (tmp_path / "datasets").exists()


def test_an_unknown_task_or_folder_is_one_line_naming_it(workspace):
    checkpoint = workspace / "tiny.ckpt"
    message = _error(["--include_path", "lm_eval_tasks", "--include_defaults", "false", "--tasks", "[python_basic]"],
                     checkpoint)
    assert "'python_basic'" in message and "python_basics" in message and "--include_path" in message
    message = _error(["--include_path", "no_such_folder", "--tasks", "[python_basics]"], checkpoint)
    assert "no_such_folder" in message and "lm_eval_tasks" in message


@pytest.mark.parametrize("offline", ["set", "hub unreachable"])
def test_a_hub_task_offline_is_one_line_naming_it_and_include_path(offline, workspace, tmp_path, monkeypatch):
    """Offline mode set (HF_HUB_OFFLINE), or a hub that does not answer: then offline mode is turned on at once,
    where ``datasets`` would retry each request for half a minute."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline == "set")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", offline == "set")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    (tmp_path / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: moh-lightning-tests/not-cached\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n')
    message = _error(["--include_path", str(tmp_path), "--include_defaults", "false", "--tasks", "[hub_task]"],
                     workspace / "tiny.ckpt")
    assert "'hub_task'" in message and "hub" in message and "--include_path lm_eval_tasks" in message
    assert constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE


@pytest.mark.slow
def test_a_tokenizer_given_and_lm_evals_own_per_sample_log(workspace, run_dir):
    """`--tokenizer` scores a checkpoint whose recorded tokenizer cannot be read (here the export's, the same ids, so
    the same score), and `--log_samples true` writes lm-eval's own samples_<task>_<time>.jsonl beside `--output`."""
    raw = torch.load(workspace / "tiny.ckpt", weights_only=False)
    raw["datamodule_hyper_parameters"]["tokenizer"] = str(run_dir / "gone")
    torch.save(raw, run_dir / "elsewhere.ckpt")
    args = ["lm-eval", "--checkpoint", "elsewhere.ckpt", "--include_path", "lm_eval_tasks", "--include_defaults",
            "false", "--tasks", "[python_basics]"]
    with pytest.raises(SystemExit, match="gone"):
        moh(args)
    moh([*args, "--tokenizer", str(workspace / "hf"), "--output", "given.json", "--log_samples", "true"])
    moh(["lm-eval", "--checkpoint", str(workspace / "tiny.ckpt"), *args[3:], "--output", "recorded.json"])
    scores = [json.loads((run_dir / name).read_text())["results"]["python_basics"] for name in ("given.json",
                                                                                                "recorded.json")]
    assert scores[0]["acc,none"] == scores[1]["acc,none"]
    logged = list(run_dir.glob("samples_python_basics_*.jsonl"))
    assert len(logged) == 1 and len(logged[0].read_text().splitlines()) == 16
    assert {"doc", "resps", "acc"} <= json.loads(logged[0].read_text().splitlines()[0]).keys()
    with pytest.raises(SystemExit, match="^moh lm-eval: --log_samples true writes the per-sample log beside"):
        moh([*args, "--log_samples", "true"])

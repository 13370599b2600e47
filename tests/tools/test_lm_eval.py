"""lm-evaluation-harness on MoH checkpoints: a local task over a JSON dataset written here, no hub access."""
from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval_tasks import QUESTIONS, write_tasks
from tiny_models import tiny_llama_config

from moh_lightning.cli import main as moh
from moh_lightning.data.text import TextDataModule, TextSource
from moh_lightning.tasks.language_model import LanguageModel
from moh_lightning.tools.lm_eval import MoHLM


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A briefly trained tiny query-norm MoH checkpoint, its transformers export, and two local tasks."""
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

    write_tasks(root, generation=True)
    return root


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


def test_lm_eval_tool_on_local_tasks_checkpoint_and_export_agree(workspace, capsys):
    results = {}
    for flag, value in (("--checkpoint", workspace / "tiny.ckpt"), ("--hf_folder", workspace / "hf")):
        output = workspace / f"results{flag}.json"
        moh(["lm-eval", flag, str(value), "--tasks", "[tiny_choice, tiny_gen]", "--include_path",
             str(workspace / "tasks"), "--include_defaults", "false", "--batch_size", "2",
             "--add_bos_token", "false", "--output", str(output)])
        results[flag] = json.loads(output.read_text())["results"]
    assert "tiny_choice" in capsys.readouterr().out
    ours, exported = results["--checkpoint"], results["--hf_folder"]
    assert 0.0 <= ours["tiny_choice"]["acc,none"] <= 1.0
    assert ours["tiny_choice"]["acc,none"] == exported["tiny_choice"]["acc,none"]
    assert ours["tiny_gen"]["exact_match,none"] == exported["tiny_gen"]["exact_match,none"]


def test_lm_eval_tool_needs_one_model():
    with pytest.raises(ValueError, match="exactly one"):
        moh(["lm-eval", "--tasks", "[tiny_choice]"])

"""A run folder that travels: what it records (a continue-tuned model's own config, its vocabulary), and what a
resume from it says and does not say."""
from __future__ import annotations

from types import SimpleNamespace

import yaml
from tiny_models import tiny_llama_config

from moh_lightning.runs import check_resumable
from moh_lightning.settings import compare_with_checkpoint
from moh_lightning.tasks.language_model import SCHEDULE_STEPS, LanguageModel

GRANITE = {"model_type": "granite", "vocab_size": 320, "hidden_size": 64, "embedding_multiplier": 3.0}


def test_a_checkpoint_that_recorded_the_tokenizers_size_as_its_vocabulary_still_evaluates():
    """Checkpoints of a continue-tuned model once held the tokenizer's size (300) in arch.vocab_size, and now the
    embedding's rows (320, its hf_config's): evaluating the one under the other is no other shape."""
    older = {"arch": {"vocab_size": 300, "depth": 2}, "hf_config": GRANITE}
    built = {"arch": {"vocab_size": 320, "depth": 2}, "hf_config": GRANITE}
    assert compare_with_checkpoint("validate", "last.ckpt", older, built, {}) is None


def test_a_run_whose_config_yaml_left_hf_config_empty_still_resumes(tmp_path):
    """A config.yaml written before it recorded the source's config (`hf_config: null`) resumes a run that now fills
    it in from init_from: nothing that makes the run differs."""
    saved = {"model": {"init_args": {"init_from": "source", "hf_config": None, "max_tokens": 10}}, "data": {}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    current = {"model": {"init_args": {"init_from": "source", "hf_config": GRANITE, "max_tokens": 20}}, "data": {}}
    assert check_resumable(tmp_path, current) == "model.init_args.max_tokens 10 -> 20"


def test_a_resume_with_a_larger_budget_says_how_the_schedule_changes():
    """The issue's run: 40 steps' budget resumed at step 39 with 50 steps' (3e-6 at step 39 jumped to 9.6e-5 and
    nothing said so). The clause names both lengths and the learning rate at the resume step before and after."""
    task = LanguageModel(tiny_llama_config(), lr=3e-4, min_lr=3e-6, warmup_steps=2, max_tokens=50 * 4 * 16)
    data = SimpleNamespace(hparams=SimpleNamespace(batch_size=4, seq_len=16))
    trainer = SimpleNamespace(accumulate_grad_batches=1, world_size=1)
    before = task.schedule(40)(39)
    checkpoint = {"lr_schedulers": [{"last_epoch": 39, "_last_lr": [before, before]}], SCHEDULE_STEPS: 40}
    said = task.schedule_change(checkpoint, data, trainer)
    assert said == (f"the learning-rate schedule now spans 50 steps, not 40: lr at step 39 {before:.2g} -> "
                    f"{task.schedule(50)(39):.2g}")
    assert task.schedule(50)(39) > 10 * before
    assert task.schedule_change({**checkpoint, SCHEDULE_STEPS: 50}, data, trainer) is None  # the same budget
    # A checkpoint that did not record its length: the learning rate alone tells whether the schedule moved.
    older = {"lr_schedulers": checkpoint["lr_schedulers"]}
    assert task.schedule_change(older, data, trainer).startswith("the learning-rate schedule now spans 50 steps: ")
    data.hparams.batch_size = 5  # a batch whose budget spans 40 steps again
    assert task.schedule_change(older, data, trainer) is None

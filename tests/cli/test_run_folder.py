"""A run folder that travels: what it records (a continue-tuned model's own config, its vocabulary), and what a
resume from it says and does not say."""
from __future__ import annotations

import yaml

from moh_lightning.runs import check_resumable
from moh_lightning.settings import compare_with_checkpoint

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

"""Local lm-eval tasks for the tests that evaluate a checkpoint or an export, so lm-eval needs no dataset hub.

Multiple choice is the shipped example, ``--include_path lm_eval_tasks`` (``python_basics``, whose YAML's path names it
too); here a generation task over three one-word questions, read from a JSON file."""
from __future__ import annotations

import json
from pathlib import Path

from moh_lightning.configs import config_dir

EXAMPLE_TASK = config_dir() / "lm_eval_tasks" / "python_basics.yaml"
QUESTIONS = [{"question": "the cat sat on the", "choices": [" mat", " sky"], "answer": 0},
             {"question": "the dog sat on the", "choices": [" rug", " mat"], "answer": 1},
             {"question": "a cat and a", "choices": [" dog", " mat"], "answer": 0}]


def write_generation_task(root: Path) -> Path:
    """Writes ``data.jsonl`` and the ``tiny_gen`` task (generate until ".", exact match) in ``root``; returns the
    folder for ``--include_path``."""
    (root / "data.jsonl").write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'data.jsonl'}\n"
        'test_split: test\noutput_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: " mat"\n'
        'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 5\nmetric_list:\n  - metric: exact_match\n')
    return tasks

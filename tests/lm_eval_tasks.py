"""Local lm-eval tasks for the tests that evaluate a checkpoint or an export: three one-word questions, read from a
JSON file, so lm-eval needs no dataset hub."""
from __future__ import annotations

import json
from pathlib import Path

QUESTIONS = [{"question": "the cat sat on the", "choices": [" mat", " sky"], "answer": 0},
             {"question": "the dog sat on the", "choices": [" rug", " mat"], "answer": 1},
             {"question": "a cat and a", "choices": [" dog", " mat"], "answer": 0}]


def write_tasks(root: Path, generation: bool = False) -> Path:
    """Writes ``data.jsonl`` and the ``tiny_choice`` task (multiple choice, acc) in ``root``, and with ``generation``
    the ``tiny_gen`` task (generate until ".", exact match); returns the folder for ``--include_path``."""
    (root / "data.jsonl").write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'data.jsonl'}\ntest_split: test\n"
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "tiny_choice.yaml").write_text(
        "task: tiny_choice\n" + common + 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n')
    if generation:
        (tasks / "tiny_gen.yaml").write_text(
            "task: tiny_gen\n" + common + 'output_type: generate_until\ndoc_to_text: "{{question}}"\n'
            'doc_to_target: " mat"\ngeneration_kwargs:\n  until: ["."]\n  max_gen_toks: 5\n'
            "metric_list:\n  - metric: exact_match\n")
    return tasks

"""Scores the DiT-on-MNIST study's trials by their samples and tables them like `moh sweep` does.

`moh sweep` compares what the trials logged; a diffusion model's quality is in its samples. For every finished trial
of `sweeps/dit_mnist_heads` this draws 300 samples (30 per class) with `moh sample` (the EMA weights, the recipe's
DDPM 250 steps and guidance 4), scores them with `moh digit_quality` against an MNIST classifier, and writes the
sweep's table and plot for class accuracy and classifier-FID into `<sweep>/quality/`, with the same statistics
(mean ± std over seeds, Welch's t-test and 95% CI against dense).

    python results/study_dit_mnist_score.py --classifier <vit_tiny_mnist checkpoint> [--sweep sweeps/dit_mnist_heads]
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import yaml

from moh_lightning.configs import resolve_config
from moh_lightning.tools.digit_quality import digit_quality
from moh_lightning.tools.sample import sample
from moh_lightning.tools.sweep_report import STATUS_FINISHED, TrialResult, write_report

NUM_SAMPLES = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classifier", required=True, help="ImageClassifier checkpoint trained on MNIST")
    parser.add_argument("--sweep", default="sweeps/dit_mnist_heads")
    parser.add_argument("--study", default="studies/dit_mnist_heads.yaml", help="the sweep's config")
    args = parser.parse_args()

    study = yaml.safe_load(Path(resolve_config(args.study)).read_text())
    (key, named), = study["grid"].items()
    labels = list(named)
    sweep = Path(args.sweep)
    trials = []
    with open(sweep / "trials.csv") as f:
        for row in csv.DictReader(f):
            trial = TrialResult(name=row["trial"], cell=labels.index(row[key]),
                                seed=int(row["seed"]), status=row["status"], run_dir=row["run_dir"])
            if trial.status == STATUS_FINISHED:
                scores_file = Path(trial.run_dir) / "digit_quality.json"
                if not scores_file.is_file():  # scored trials are kept: a re-run scores only the new ones
                    out = Path(trial.run_dir) / "samples"
                    sample(checkpoint=str(Path(trial.run_dir) / "checkpoints" / "last.ckpt"), out_dir=str(out),
                           num_samples=NUM_SAMPLES, classes=list(range(10)), seed=0)
                    digit_quality(samples=str(out / "samples.npz"), classifier=args.classifier,
                                  out=str(scores_file))
                scores = json.loads(scores_file.read_text())
                trial.metrics = {"class_accuracy": scores["class_accuracy"],
                                 "classifier_fid": scores["classifier_fid"]}
            trials.append(trial)
    cells = [{key: label} for label in labels]
    for metric, mode in (("classifier_fid", "min"), ("class_accuracy", "max")):
        out = sweep / "quality" / metric
        paths = write_report(out, trials, cells, study["seeds"], metric, mode, 0,
                             title=f"{args.study}: {NUM_SAMPLES} samples per trial")
        print(paths["markdown"])


if __name__ == "__main__":
    main()

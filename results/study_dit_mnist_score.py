"""Scores the DiT-on-MNIST study's trials by their samples and tables them like `moh sweep` does.

`moh sweep` compares what the trials logged; a diffusion model's quality is in its samples. For every finished trial
of `sweeps/dit_mnist_heads` (also while the sweep still runs) this draws 200 samples (20 per class) with `moh sample`
(the EMA weights, the recipe's DDPM sampler and guidance 4, respaced to 100 steps), scores them with
`moh digit_quality` against an MNIST classifier, and writes the sweep's table and plot for class accuracy and
classifier-FID into `<sweep>/quality/`, with the same statistics (mean ± std over seeds, Welch's t-test and 95% CI
against dense).

    python results/study_dit_mnist_score.py --classifier <vit_tiny_mnist checkpoint> [--shard 0/2]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from moh_lightning.configs import resolve_config
from moh_lightning.sweep.grid import grid_cells, trial_names
from moh_lightning.sweep.ray_tune import DONE_FILE
from moh_lightning.sweep.report import STATUS_FINISHED, STATUS_UNFINISHED, TrialResult, write_report
from moh_lightning.tools.digit_quality import digit_quality
from moh_lightning.tools.sample import sample

NUM_SAMPLES = 200  # 20 per class
STEPS = 100        # DDPM with the learned variance, respaced from the recipe's 250 to fit the session's CPU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classifier", required=True, help="ImageClassifier checkpoint trained on MNIST")
    parser.add_argument("--sweep", default="sweeps/dit_mnist_heads")
    parser.add_argument("--study", default="studies/dit_mnist_heads.yaml", help="the sweep's config")
    parser.add_argument("--shard", default="0/1", help="i/n: score every n-th trial from the i-th (parallel runs)")
    args = parser.parse_args()

    study = yaml.safe_load(Path(resolve_config(args.study)).read_text())
    _, shown = grid_cells(study["grid"])
    names = trial_names(shown, study["seeds"])
    shard, shards = map(int, args.shard.split("/"))
    trials = []
    for index, ((c, s), name) in enumerate(names.items()):
        trial = TrialResult(name=name, cell=c, seed=study["seeds"][s])
        done = Path(args.sweep) / "runs" / name / DONE_FILE   # written when the trial's fit returned
        if done.is_file():
            trial.status, trial.run_dir = STATUS_FINISHED, json.loads(done.read_text())["run_dir"]
            scores_file = Path(trial.run_dir) / "digit_quality.json"
            if not scores_file.is_file() and index % shards == shard:  # scored trials are kept
                out = Path(trial.run_dir) / "samples"
                sample(checkpoint=str(Path(trial.run_dir) / "checkpoints" / "last.ckpt"), out_dir=str(out),
                       num_samples=NUM_SAMPLES, classes=list(range(10)), steps=STEPS, seed=0, batch_size=100)
                digit_quality(samples=str(out / "samples.npz"), classifier=args.classifier, out=str(scores_file))
            if scores_file.is_file():
                scores = json.loads(scores_file.read_text())
                trial.metrics = {k: scores[k] for k in ("class_accuracy", "classifier_fid")}
            else:  # another shard's, not scored yet
                trial.status = STATUS_UNFINISHED
        trials.append(trial)
    for metric, mode in (("classifier_fid", "min"), ("class_accuracy", "max")):
        out = Path(args.sweep) / "quality" / metric
        paths = write_report(out, trials, shown, study["seeds"], metric, mode, 0,
                             title=f"{args.study}: {NUM_SAMPLES} samples per trial")
        print(paths["markdown"])


if __name__ == "__main__":
    main()

"""Writes results/continue_hf.md: for each family `moh convert-hf` supports, held-out perplexity of a tiny random model
(tests/hf_families.py) dense, converted to 75% of heads, and after a short continue-tuning at 75% (continue_hf_75.yaml).

    OMP_NUM_THREADS=1 PYTHONPATH=. python results/continue_hf.py [work folder]

Everything is local: each family's model and tokenizer are built here, the text is a few packages of the running
interpreter's standard library. The models are random, so the numbers show the path works end to end (conversion keeps
the model, continue-tuning lowers the held-out loss at 75%), not what a pretrained model would reach.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hf_families import FAMILIES, save_family  # noqa: E402

from moh_lightning.cli import main  # noqa: E402
from moh_lightning.trainer_cli import MoHLightningCLI  # noqa: E402

STEPS, BATCH, SEQ = 150, 8, 64
PACKAGES = ("json", "email", "http", "urllib", "logging")


def corpus(folder: Path) -> Path:
    """A few standard-library packages' .py files, copied so that the data module splits them by file."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    folder.mkdir(parents=True, exist_ok=True)
    for package in PACKAGES:
        for file in (stdlib / package).glob("*.py"):
            shutil.copyfile(file, folder / f"{package}_{file.name}")
    return folder


def common(source: Path, text: Path) -> list[str]:
    return ["--config", "continue_hf_75.yaml", "--model.init_args.init_from", str(source),
            "--data.init_args.tokenizer", str(source),
            "--data.init_args.sources", f"[{{path: {text}, pattern: '*.py'}}]",
            "--data.init_args.seq_len", str(SEQ), "--data.init_args.batch_size", str(BATCH),
            "--data.init_args.val_samples", "64", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false"]


def validate(args: list[str]) -> float:
    cli = MoHLightningCLI(args=["validate", *args])
    return float(cli.trainer.callback_metrics["val/ppl"])


def main_(work: Path) -> None:
    os.chdir(work)
    text = corpus(work / "text")
    rows = []
    for family in sorted(FAMILIES):
        source = save_family(family, work / family / "source")
        main(["convert-hf", "--source", str(source), "--out", str(work / family / "moh75")])
        dense = validate([*common(source, text), "--model.init_args.arch", "{moh: null}"])
        converted = validate(common(work / family / "moh75", text))
        start = time.perf_counter()
        main(["fit", *common(work / family / "moh75", text), "--trainer.logger.init_args.name", family,
              "--model.init_args.max_tokens", str(STEPS * BATCH * SEQ), "--model.init_args.lr", "3e-3",
              "--model.init_args.min_lr", "3e-4", "--model.init_args.warmup_steps", "10",
              "--trainer.val_check_interval", str(STEPS), "--checkpoint.every_n_train_steps", str(STEPS)])
        seconds = time.perf_counter() - start
        last = sorted((work / "runs" / family).glob("version_*/checkpoints/last.ckpt"))[-1]
        tuned = validate([*common(work / family / "moh75", text), "--ckpt_path", str(last)])
        rows.append((family, dense, converted, tuned, seconds))
    lines = ["# Continue-tuning transformers causal LMs into MoH (`moh convert-hf`, `continue_hf_75.yaml`)", "",
             "Held-out perplexity (tokens of the data module's validation split: whole files held out) of tiny random",
             "models of each family (2 layers, width 64, 8 heads of which 2 key / value heads, a 300-token BPE trained",
             "locally; `tests/hf_families.py`), on the .py files of the standard library's "
             f"{', '.join(PACKAGES)} packages:", "",
             "* **dense**: the source model, every head (`--model.init_args.arch '{moh: null}'`);",
             "* **75%, converted**: after `moh convert-hf` (4 shared + top-2 of 4 routed heads per layer, query-norm",
             "  router), before any tuning;",
             f"* **75%, tuned**: after `moh fit --config continue_hf_75.yaml` from the converted folder, {STEPS} steps "
             f"of {BATCH} x {SEQ} tokens (lr 3e-3 -> 3e-4, 10 warm-up steps; the config's own lr 2e-5 is for "
             "pretrained models).", "",
             "| family | dense | 75%, converted | 75%, tuned | tuning time (s) |", "|---|---|---|---|---|",
             *(f"| {family} | {dense:.1f} | {converted:.1f} | {tuned:.1f} | {seconds:.0f} |"
               for family, dense, converted, tuned, seconds in rows), "",
             "The models are random, so 'dense' and 'converted' are near the vocabulary size and the tuned column "
             "shows continue-tuning at 75% works for each family (and resumes exactly, "
             "`tests/models/hf_causal/test_continue_hf.py`), not what a pretrained model reaches. With every head "
             "kept, a converted model's logits equal the source's bit for bit "
             "(`tests/models/hf_causal/test_convert_hf.py`).", "",
             f"Reproduce: `OMP_NUM_THREADS=1 PYTHONPATH=. python results/continue_hf.py` (CPU, {os.cpu_count()} "
             "cores here, one thread).", ""]
    (ROOT / "results" / "continue_hf.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main_(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))

"""Nothing a user has is overwritten, and names stay names (issue 47).

Every command that writes a file or folder leaves a user's file in its target byte for byte and stops in one line
naming the option and the path, before it loads anything; with ``--overwrite true`` it writes. A run name that is a
path is refused before anything is written outside the working folder. The inputs are tiny random checkpoints.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import dit_t4_config, tiny_llama_config

from moh_lightning.callbacks.head_load.loads import HeadLoadSnapshot, LayerLoad
from moh_lightning.cli import main as moh
from moh_lightning.models.vit import ViTConfig, create_vit
from moh_lightning.outputs import created_folder
from moh_lightning.tasks import ClassConditionalDiffusion, ImageClassifier, LanguageModel
from moh_lightning.tasks.checkpoints import write_checkpoint

# MNIST's shape, so that digit_quality's classifier and `moh predict` read it as vit_tiny_mnist_75.yaml trains it.
TINY_VIT = dict(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=32, depth=1, num_heads=4,
                mlp_ratio=2.0, global_pool="avg", moh={"num_shared_heads": 2, "top_k": 1})
USER_FILES = {"README.md": b"# my own notes\n", "config.json": b'{"mine": true}\n', "grid.png": b"my picture",
              "samples.npz": b"my samples", "sample_args.json": b"{}", "new.csv": b"file,class_1\nmine.png,7\n",
              "my.ckpt": b"my checkpoint"}
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A tiny random checkpoint of each kind the tools read, and a tiny transformers LLaMA folder."""
    import transformers

    root = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    dit = dit_t4_config(depth=1)
    diffusion = ClassConditionalDiffusion(dit)
    vit = ViTConfig(**TINY_VIT)
    lm = LanguageModel(tiny_llama_config())
    lm.configure_model()
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "llama")
    return {
        "dit": write_checkpoint(root / "dit.ckpt", ClassConditionalDiffusion, {"arch": asdict(dit)},
                                diffusion.state_dict(), {}),
        "vit": write_checkpoint(root / "vit.ckpt", ImageClassifier, {"arch": asdict(vit), "mixup_alpha": 0.0,
                                                                     "cutmix_alpha": 0.0},
                                # no mean / std: a grayscale classifier exports the defaults averaged to one channel
                                {f"model.{k}": v for k, v in create_vit(vit).state_dict().items()}, {}),
        "lm": write_checkpoint(root / "lm.ckpt", LanguageModel, {"arch": asdict(lm.model.config)}, lm.state_dict(),
                               {"tokenizer": "byte"}),
        "llama": root / "llama",
    }


def _user_folder(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in USER_FILES.items():
        (folder / name).write_bytes(content)
    return dict(USER_FILES)


def _held(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in USER_FILES}


def _refused(args: list[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        moh(args)
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith("moh"), message
    return message


def _says(message: str, option: str, path: Path, flag: str = "--overwrite") -> None:
    assert f"{option} {path}" in message and f"pass {flag} true" in message and "another path" in message, message


# Each writing tool's command line with its output folder as {out} (the inputs in {dit}, {vit}, {lm}, {llama}).
FOLDER_TOOLS = {
    "sample": ["sample", "--checkpoint", "{dit}", "--out_dir", "{out}", "--num_samples", "2", "--steps", "2",
               "--sampler", "ddim"],
    "export-hf": ["export-hf", "--checkpoint", "{lm}", "--out", "{out}"],
    "export-timm": ["export-timm", "--checkpoint", "{vit}", "--out", "{out}"],
    "convert-hf": ["convert-hf", "--source", "{llama}", "--out", "{out}"],
    "convert-llama": ["convert-llama", "--source", "{llama}", "--out", "{out}"],
}
OPTION = {"sample": "--out_dir"}


@pytest.mark.parametrize("tool", FOLDER_TOOLS)
def test_a_tool_keeps_the_users_folder_and_writes_over_it_only_when_told(tool, checkpoints, tmp_path):
    out = tmp_path / "mine"
    mine = _user_folder(out)
    args = [arg.format(out=out, **checkpoints) for arg in FOLDER_TOOLS[tool]]
    _says(_refused(args), OPTION.get(tool, "--out"), out)
    assert _held(out) == mine and sorted(p.name for p in out.iterdir()) == sorted(mine)
    moh([*args, "--overwrite", "true"])
    written = {"sample": "samples.npz", "export-timm": "config.json"}.get(tool, "README.md")
    assert (out / written).read_bytes() != mine[written]


@pytest.mark.parametrize("args, option", [
    (["load-authors-dit", "--source", "absent.pt", "--out", "{out}/my.ckpt"], "--out"),
    (["load-authors-llama", "--source", "absent", "--out", "{out}/my.ckpt"], "--out"),
    (["load-authors-llama", "--source", "absent", "--out", "{out}"], "--out"),
    (["fidelity", "--samples", "absent.npz", "--out", "{out}/config.json"], "--out"),
    (["digit_quality", "--samples", "absent.npz", "--classifier", "{vit}", "--out", "{out}/config.json"], "--out"),
    (["lm-eval", "--checkpoint", "{lm}", "--include_path", "absent", "--output", "{out}/config.json"], "--output"),
    (["head-figures", "--run", "absent", "--out", "{out}"], "--out"),
])
def test_every_other_writing_tool_refuses_before_it_reads_its_input(args, option, checkpoints, tmp_path):
    """Refused first, although the input is missing; with --overwrite true the same command gets past the check to
    the missing input."""
    out = tmp_path / "mine"
    mine = _user_folder(out)
    args = [arg.format(out=out, **checkpoints) for arg in args]
    message = _refused(args)
    _says(message, option, Path(args[args.index(option) + 1]))
    assert _held(out) == mine
    with pytest.raises((SystemExit, FileNotFoundError, OSError, ValueError)) as later:
        moh([*args, "--overwrite", "true"])
    assert "--overwrite true" not in str(later.value), later.value
    assert _held(out) == mine


def test_file_outputs_are_written_when_told(checkpoints, run_dir, monkeypatch):
    """digit_quality's JSON, head-figures' folder and bench's page (its sections stubbed) with --overwrite true."""
    from moh_lightning.tools import bench as bench_module

    mine = _user_folder(run_dir / "mine")
    samples = np.zeros((4, 32, 32, 3), np.uint8)
    np.savez(run_dir / "samples.npz", arr_0=samples, arr_1=np.arange(4))
    moh(["digit_quality", "--samples", "samples.npz", "--classifier", str(checkpoints["vit"]), "--out",
         "mine/config.json", "--overwrite", "true"])
    assert json.loads((run_dir / "mine" / "config.json").read_text())["num_samples"] == 4

    HeadLoadSnapshot(step=1, epoch=0, split="validation", layers=[LayerLoad(0, 4, 2, 1, [1, 1, 0.5, 0.5])]).save(
        run_dir / "run" / "head_load")
    moh(["head-figures", "--run", "run", "--out", "mine", "--formats", "[png]", "--overwrite", "true"])
    assert (run_dir / "mine" / "layers.png").is_file() and _held(run_dir / "mine")["README.md"] == mine["README.md"]

    for section in ("op_count_section", "core_section", "layer_section", "decode_section", "model_section"):
        monkeypatch.setattr(bench_module, section, lambda *args, **kwargs: None)
    bench = ["bench", "--quick", "true", "--output", "mine/README.md"]
    _says(_refused(bench), "--output", Path("mine/README.md"))
    assert _held(run_dir / "mine")["README.md"] == mine["README.md"]
    moh([*bench, "--overwrite", "true"])
    assert (run_dir / "mine" / "README.md").read_bytes() != mine["README.md"]


def test_sample_of_no_images_is_refused_before_any_folder_is_made(checkpoints, tmp_path):
    message = _refused(["sample", "--checkpoint", str(checkpoints["dit"]), "--out_dir", str(tmp_path / "new"),
                        "--num_samples", "0"])
    assert "'num_samples': 0" in message and not (tmp_path / "new").exists()


def test_a_failing_tool_removes_the_folder_it_made_and_no_other(tmp_path):
    with pytest.raises(RuntimeError), created_folder(tmp_path / "a" / "b") as folder:
        (folder / "partial.png").write_bytes(b"half")
        raise RuntimeError("failed halfway")
    assert list(tmp_path.iterdir()) == []
    _user_folder(tmp_path / "mine")
    with pytest.raises(RuntimeError), created_folder(tmp_path / "mine"):
        raise RuntimeError("failed halfway")
    assert _held(tmp_path / "mine") == USER_FILES


def _new_images(folder: Path) -> None:
    folder.mkdir()
    for i in range(2):
        Image.fromarray(np.full((28, 28), 40 * i, np.uint8), mode="L").save(folder / f"digit{i}.png")


@pytest.mark.slow
def test_predict_keeps_the_users_folder_and_numbers_its_own_files(checkpoints, run_dir):
    _new_images(run_dir / "new")
    mine = _user_folder(run_dir / "mine")
    args = ["predict", "--config", "vit_tiny_mnist_75.yaml", "--ckpt_path", str(checkpoints["vit"]),
            "--trainer.logger=false", "--data.init_args.predict_dir", "new", *QUIET]
    message = _refused([*args, "--predictions.output", "mine"])
    _says(message, "--predictions.output", Path("mine"), "--predictions.overwrite")
    assert _held(run_dir / "mine") == mine
    moh([*args, "--predictions.output", "mine", "--predictions.overwrite", "true"])
    assert (run_dir / "mine" / "new.csv").read_bytes() != mine["new.csv"]
    # Beside the checkpoint, the earlier predictions of the same images stay and the new ones are numbered.
    for _ in range(2):
        moh(args)
    written = sorted(path.name for path in (checkpoints["vit"].parent / "predictions").iterdir())
    assert written == ["new-2.csv", "new.csv"]


@pytest.mark.parametrize("key, name", [("name", "../../escaped_run"), ("name", "{tmp}/escaped_run"), ("name", ".."),
                                       ("version", "../escaped_run")])
def test_a_run_name_that_is_a_path_is_refused_and_nothing_is_written(key, name, tmp_path, monkeypatch):
    work = tmp_path / "a" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    name = name.format(tmp=tmp_path)
    message = _refused(["fit", "--config", "vit_tiny_mnist_75.yaml", f"--trainer.logger.init_args.{key}", name,
                        "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", *QUIET])
    assert f"--trainer.logger.init_args.{key} {name!r} is a path, not a name" in message, message
    assert sorted(tmp_path.rglob("*")) == [tmp_path / "a", work]


@pytest.mark.parametrize("logger, key", [("lightning.pytorch.loggers.MLFlowLogger", "run_name"),
                                         ("lightning.pytorch.loggers.WandbLogger", "name")])
def test_a_logger_run_name_that_is_a_path_is_refused(logger, key, run_dir, mlflow_uri_unset):
    pytest.importorskip(logger.rsplit(".", 1)[-1].removesuffix("Logger").lower())
    message = _refused(["fit", "--config", "vit_tiny_mnist_75.yaml", "--trainer.logger", logger,
                        f"--trainer.logger.init_args.{key}", "../escaped", "--trainer.max_steps", "1", *QUIET])
    assert f"--trainer.logger.init_args.{key} '../escaped' is a path, not a name" in message, message
    assert not (run_dir.parent / "escaped").exists() and list(run_dir.iterdir()) == []

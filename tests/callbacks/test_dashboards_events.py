"""The head-load dashboards as TensorBoard's own reader (``EventAccumulator``) sees them: an evaluation at its
checkpoint's step, the last training heatmap at the last step, a histogram per routed layer every window, a card per
routed layer with a colour and legend entry per head, and runs a MoH run and its dense baseline tell apart."""
import io
from pathlib import Path

import numpy as np
import pytest
from dashboard_cases import ROUTED_HEADS, TinyTask, fit_tiny
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib import colormaps
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

from moh_lightning.callbacks import HeadLoadCallback, LoggerRuns
from moh_lightning.callbacks.head_load.loads import HeadLoadSnapshot
from moh_lightning.cli import main
from moh_lightning.runs import name_for_budget

EVEN = 2 / 3  # layer 0 of TinyTask: top-2 of 3 routed heads


def _events(folder) -> EventAccumulator:
    return EventAccumulator(str(folder), size_guidance={"images": 0, "histograms": 0, "scalars": 0,
                                                        "tensors": 0}).Reload()


def _steps(events: EventAccumulator, kind: str, tag: str) -> list[int]:
    return [event.step for event in getattr(events, kind)(tag)]


@pytest.mark.slow
def test_an_evaluation_is_logged_at_its_checkpoints_step(tmp_path):
    trainer = fit_tiny(TinyTask(), TensorBoardLogger(tmp_path, name="tb", version=0), tmp_path)
    checkpoint = tmp_path / "step6.ckpt"
    trainer.save_checkpoint(checkpoint)
    for evaluation, tag in (("validate", "val"), ("test", "test")):
        logger = TensorBoardLogger(tmp_path, name="tb", version=evaluation)
        evaluator = Trainer(logger=logger, callbacks=[HeadLoadCallback(), LoggerRuns()], enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=2, limit_test_batches=2)
        getattr(evaluator, evaluation)(TinyTask(), ckpt_path=checkpoint)
        events = _events(logger.log_dir)
        # Lightning's own metric and the head-load heatmaps at step 6, beside the fit's curves, not at 0.
        assert _steps(events, "Scalars", f"{tag}/loss") == [6], evaluation
        assert _steps(events, "Images", f"head_load/heatmap_{tag}") == [6], evaluation
        assert _steps(events, "Images", "head_load/per_class_layer_00") == [6], evaluation
        snapshot = HeadLoadSnapshot.load(Path(logger.log_dir) / "head_load" / "loads.json")
        assert snapshot.step == 6  # the heatmap's title, "Head load · validation · step 6", is drawn from it


@pytest.mark.slow
def test_each_window_has_its_histograms_and_the_last_heatmap_and_coloured_load_card_are_the_last_steps(tmp_path):
    # Windows of 2 batches close at steps 2, 4 and 6; the seventh step's batch closes one more when training ends.
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    fit_tiny(TinyTask(), logger, tmp_path, max_steps=7)
    events = _events(logger.log_dir)
    assert _steps(events, "Images", "head_load/heatmap_train") == [2, 7]
    assert _steps(events, "Images", "head_load/over_time_layer_00") == [2, 7]
    assert _steps(events, "Scalars", "head_load_per_head/layer_00/head_01") == [2, 4, 6, 7]
    assert _steps(events, "Histograms", "head_load_vs_even/layer_00") == [2, 4, 6, 7]

    tags = events.Tags()
    # The Histograms and Distributions tabs: routed layer 0 only (layer 1 has 4 shared heads and no router).
    assert tags["histograms"] == ["head_load_vs_even/layer_00"]
    assert tags["distributions"] == ["head_load_vs_even/layer_00"]
    for event in events.Histograms("head_load_vs_even/layer_00"):
        loads = [events.Scalars(f"head_load_per_head/layer_00/head_{head:02d}")[[2, 4, 6, 7].index(event.step)].value
                 for head in ROUTED_HEADS]
        histogram = event.histogram_value
        assert histogram.num == len(ROUTED_HEADS)
        # Load ÷ even load, so 1 is even: the three heads serve top-2 slots per token, their ratios sum to 3.
        assert histogram.sum == pytest.approx(3.0, abs=1e-5)
        assert histogram.min == pytest.approx(min(loads) / EVEN, abs=1e-5)
        assert histogram.max == pytest.approx(max(loads) / EVEN, abs=1e-5)

    # The last load-over-time card (four windows): each routed head has its own colour and legend entry.
    image = events.Images("head_load/over_time_layer_00")[-1]
    card = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB")).astype(int)
    height, width, _ = card.shape
    assert width / height > 1.6 and width >= 560  # wide, as the heatmap cards, to stay readable at card size
    legend = card[:, int(0.8 * width):]  # right of the plot
    for head in range(len(ROUTED_HEADS)):
        colour = np.asarray(colormaps["tab10"](head)[:3]) * 255
        for area, where in ((card, "card"), (legend, "legend")):
            assert (np.abs(area - colour).max(-1) < 12).sum() > 20, f"head {ROUTED_HEADS[head]}'s colour in the {where}"
    assert (np.abs(legend - 0).max(-1) < 40).sum() > 50  # the even line's black dashes and the legend's text


def _trial(folder) -> str:
    events = _events(folder)
    content = events.summary_metadata["_hparams_/session_start_info"].plugin_data.content
    return HParamsPluginData.FromString(content).session_start_info.group_name


@pytest.mark.slow
def test_a_moh_run_and_its_dense_baseline_are_told_apart_in_the_hparams_trial_column(tmp_path):
    moh, dense = (TensorBoardLogger(tmp_path, name=name, version=0) for name in ("tiny_75", "tiny_dense"))
    fit_tiny(TinyTask(), moh, tmp_path)
    fit_tiny(TinyTask(dense=True), dense, tmp_path)
    # The trial column shows ~16 characters: the budget and version come first.
    assert _trial(moh.log_dir) == "88% v0 tiny_75"
    assert _trial(dense.log_dir) == "dense v0 tiny_dense"


VIT = {"img_size": 32, "patch_size": 8, "in_chans": 1, "num_classes": 10, "embed_dim": 64, "depth": 6, "num_heads": 8}


def _model(moh: dict | None) -> Namespace:
    arch = Namespace(**VIT, moh=None if moh is None else Namespace(**moh))
    return Namespace(class_path="moh_lightning.tasks.ImageClassifier", init_args=Namespace(arch=arch))


@pytest.mark.parametrize(("typed", "moh", "name"), [
    ([], {"num_shared_heads": 2, "top_k": 4}, "vit_tiny_folder_digits_75"),       # the config's own budget
    (["arch.moh"], None, "vit_tiny_folder_digits_dense"),                         # --model.init_args.arch.moh null
    (["arch.moh.top_k"], {"num_shared_heads": 2, "top_k": 2}, "vit_tiny_folder_digits_50"),
    (["arch.moh.top_k"], {"num_shared_heads": 2, "top_k": 4}, "vit_tiny_folder_digits_75"),  # restated
    (["lr"], None, "vit_tiny_folder_digits_75"),                                  # the budget is not on the line
])
def test_the_default_run_name_says_the_head_budget_the_command_line_set(typed, moh, name):
    assert name_for_budget("vit_tiny_folder_digits_75", _model(moh), typed) == name
    assert name_for_budget("my_experiment", _model(None), ["arch.moh"]) == "my_experiment_dense"


@pytest.mark.slow
def test_moh_fit_of_a_dense_baseline_lands_in_its_own_run_and_its_summary_names_a_dense_budget(tmp_path, monkeypatch,
                                                                                               capsys):
    monkeypatch.chdir(tmp_path)
    smoke = ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--data.init_args.batch_size=16",
             "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false"]
    main(["fit", "--config", "vit_tiny_mnist_75.yaml", *smoke, "--model.init_args.arch.moh", "null"])
    assert sorted(path.name for path in (tmp_path / "runs").iterdir()) == ["vit_tiny_mnist_dense"]
    assert _trial(tmp_path / "runs" / "vit_tiny_mnist_dense" / "version_0") == "dense v0 vit_tiny_mnist_dense"
    budget = next(line for line in capsys.readouterr().out.splitlines() if "head budget:" in line)
    assert budget.endswith("head budget: 100.0% of heads active per token (dense: no routed layer)")

"""Head-load dashboards: what reaches TensorBoard, Weights & Biases (offline), MLflow (sqlite store) and the run
folder, and the paper figures of ``moh head-figures``. A real TensorBoard server: test_dashboards_tensorboard.py; each
logger through a stopped and continued ``moh fit``: test_logger_runs.py."""
import csv
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from dashboard_cases import ROUTED_HEADS, TinyTask, fit_tiny
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moh_lightning.callbacks.head_load import run_hparams
from moh_lightning.callbacks.head_load.loads import GroupLoad, HeadLoadSnapshot, LayerLoad, load_entropy
from moh_lightning.callbacks.head_load.render import group_card, layer_card
from moh_lightning.cli import main
from moh_lightning.layers import MoHAttention
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.dit import DiTConfig
from moh_lightning.tasks.diffusion import ClassConditionalDiffusion


def _csv_rows(folder: Path) -> list[dict[str, str]]:
    with open(folder / "metrics.csv") as file:
        return list(csv.DictReader(file))


@pytest.mark.slow
def test_csv_run_folder_gets_heatmaps_loads_summary_and_exact_per_head_scalars_and_head_figures_draws_it(tmp_path):
    trainer = fit_tiny(TinyTask(timesteps=True), CSVLogger(tmp_path, name="run", version=0), tmp_path)
    folder = Path(trainer.log_dir) / "head_load"
    for name in ("layers.png", "class_layer_00.png", "timestep_layer_00.png", "loads.json", "loads_history.jsonl",
                 "summary.md", "loads_over_time.png"):
        assert (folder / name).is_file(), name
    assert not (folder / "class_layer_01.png").exists()  # layer 1 routes nothing: no group view
    rows = [row for row in _csv_rows(Path(trainer.log_dir)) if row.get("head_load_per_head/layer_00/head_01")]
    assert len(rows) == 3  # 6 steps, windows of 2
    for row in rows:
        loads = [float(row[f"head_load_per_head/layer_00/head_{h:02d}"]) for h in ROUTED_HEADS]
        assert all(0 <= load <= 1 for load in loads)
        assert sum(loads) == pytest.approx(2.0)  # every token uses exactly top-2 routed heads
        balanced = 2 / 3
        assert float(row["head_load_balance/layer_00/busiest_head_vs_balanced"]) == pytest.approx(max(loads) / balanced)
        assert float(row["head_load_balance/layer_00/idlest_head_vs_balanced"]) == pytest.approx(min(loads) / balanced)
    columns = set(rows[0])
    assert not any("collapsed" in column or "entropy" in column and "final" not in column for column in columns)
    assert not any(column.startswith("head_load_per_head/layer_01") for column in columns)  # no routed heads there
    snapshot = HeadLoadSnapshot.load(folder / "loads.json")
    assert snapshot.split == "validation" and snapshot.step == 6
    assert [(layer.shared, layer.top_k, layer.routed) for layer in snapshot.layers] == [(1, 2, 3), (4, 0, 0)]
    assert snapshot.layers[1].load == [1.0] * 4 and snapshot.layers[0].load[0] == 1.0
    kinds = {(group.kind, group.layer): group for group in snapshot.groups}
    assert set(kinds) == {("class", 0), ("timestep", 0)}
    assert kinds["class", 0].labels == ["0", "1", "2"]
    assert kinds["timestep", 0].labels == ["t 0–249", "t 250–499", "t 500–749", "t 750–999"]
    for group in snapshot.groups:  # each group's routed loads also sum to top-k
        for row, tokens in zip(group.load, group.tokens, strict=True):
            assert tokens == 0 or sum(row) == pytest.approx(2.0)
    history = [json.loads(line) for line in (folder / "loads_history.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in history] == [3, 6]
    summary = (folder / "summary.md").read_text()
    assert "| layer | budget |" in summary and "| 0 | 1 shared + top-2 of 3 routed |" in summary
    assert "4 shared heads (no routed heads)" in summary and "No routed head fell under 1%" in summary

    # `moh head-figures`: the paper figures from the run folder, no checkpoint needed.
    out = tmp_path / "figs"
    main(["head-figures", "--run", str(Path(trainer.log_dir)), "--out", str(out)])
    for stem in ("layers", "class_layer_00", "timestep_layer_00"):
        assert (out / f"{stem}.pdf").read_bytes().startswith(b"%PDF")
        assert Image.open(out / f"{stem}.png").size[0] > 300
    main(["head-figures", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "newest"), "--formats", "[svg]"])
    assert sorted(p.name for p in (tmp_path / "newest").iterdir()) == [
        "class_layer_00.svg", "layers.svg", "timestep_layer_00.svg"]
    with pytest.raises(SystemExit, match="no head_load/loads.json"):
        main(["head-figures", "--run", str(tmp_path / "figs"), "--out", str(tmp_path / "x")])


@pytest.mark.slow
def test_tensorboard_events_hold_images_text_layout_and_first_hparams_record(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer = fit_tiny(TinyTask(), logger, tmp_path, images_every_n_windows=1)
    events = EventAccumulator(trainer.log_dir, size_guidance={"images": 0, "tensors": 0}).Reload()
    tags = events.Tags()
    assert {"head_load/heatmap_train", "head_load/heatmap_val", "head_load/per_class_layer_00"} <= set(tags["images"])
    # Windows end at steps 2, 4 and 6, each drawn (by default the first, every 10th and the last: the validations'
    # test below).
    assert [image.step for image in events.Images("head_load/heatmap_train")] == [2, 4, 6]
    assert [image.step for image in events.Images("head_load/over_time_layer_00")] == [2, 4, 6]
    assert "head_load/over_time_layer_01" not in tags["images"]  # layer 1 routes nothing
    assert len(events.Images("head_load/heatmap_val")) == 2
    assert "head_load_balance/final_load_entropy" in tags["scalars"]
    assert "head_load/summary/text_summary" in tags["tensors"]
    # Ours is the run's first HParams record (Lightning writes its hp_metric record after on_fit_start).
    hparams = events.summary_metadata["_hparams_/session_start_info"].plugin_data.content
    assert b"moh/activated_fraction" in hparams and b"hp_metric" not in hparams
    experiment = events.summary_metadata["_hparams_/experiment"].plugin_data.content
    assert b"val/loss" in experiment and b"head_load_balance/final_load_entropy" in experiment


def test_hparams_have_one_vocabulary_read_from_the_built_model():
    routed = run_hparams(TinyTask(), [m for m in TinyTask().modules() if isinstance(m, MoHAttention)])
    assert routed == {"task": "TinyTask", "moh/activated_fraction": pytest.approx(7 / 8), "net/heads_per_layer": 4,
                      "moh/shared_heads": 2.5, "moh/top_k": 1.0, "moh/router": "learned",
                      "moh/two_stage_routing": "true", "moh/load_balance_beta": 0.01, "net/layers": 2,
                      "net/routed_layers": 1}
    # The head budget sorts first: TensorBoard's HParams tab shows the first five by name.
    assert sorted(routed)[:5] == ["moh/activated_fraction", "moh/load_balance_beta", "moh/router", "moh/shared_heads",
                                  "moh/top_k"]
    dense = TinyTask(dense=True)
    hparams = run_hparams(dense, [m for m in dense.modules() if isinstance(m, MoHAttention)])
    assert hparams["moh/router"] == "dense" and hparams["moh/activated_fraction"] == 1.0
    assert hparams["moh/shared_heads"] == 4 and hparams["moh/top_k"] == 0


def test_dense_model_gets_hparams_and_a_summary_but_no_heatmaps(tmp_path):
    trainer = fit_tiny(TinyTask(dense=True), CSVLogger(tmp_path, name="", version=""), tmp_path)
    folder = Path(trainer.log_dir) / "head_load"
    assert "No routed head measured (a dense model" in (folder / "summary.md").read_text()
    assert not (folder / "layers.png").exists()
    assert not any(column.startswith("head_load") for column in _csv_rows(Path(trainer.log_dir))[0])


def test_collapse_series_starts_at_the_first_collapse_and_the_summary_names_it(tmp_path):
    trainer = fit_tiny(TinyTask(starve=True), CSVLogger(tmp_path, name="", version=""), tmp_path, max_steps=8,
                   collapse_windows=2)
    rows = _csv_rows(Path(trainer.log_dir))
    collapsed = [float(row["head_load/layer_00/collapsed_heads"]) for row in rows
                 if row.get("head_load/layer_00/collapsed_heads")]
    windows = [row for row in rows if row.get("head_load_per_head/layer_00/head_01")]
    assert len(windows) == 4 and collapsed == [2, 2, 2]  # absent in window 1, then both starved heads
    summary = (Path(trainer.log_dir) / "head_load" / "summary.md").read_text()
    assert "head 2 at step 4; head 3 at step 4" in summary and "(collapsed)" in summary


@pytest.mark.slow
def test_wandb_offline_run_gets_heatmaps_tables_summary_metrics_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=tmp_path, offline=True, project="moh-dashboards")
    try:
        fit_tiny(TinyTask(timesteps=True), logger, tmp_path)
        run_dir = Path(logger.experiment.dir).parent
    finally:
        logger.experiment.finish()
    media = {path.relative_to(run_dir / "files" / "media").as_posix()
             for path in (run_dir / "files" / "media").rglob("*") if path.is_file()}
    for prefix in ("images/head_load/heatmap_train_", "images/head_load/heatmap_val_",
                   "images/head_load/per_class_layer_00_", "images/head_load/per_timestep_layer_00_",
                   "html/head_load/summary_", "table/head_load/loads_", "table/head_load_per_head/layer_00_table_"):
        assert any(name.startswith(prefix) for name in media), prefix
    # Scalars and config live in W&B's own run log (its keys are stored as text in it), which W&B's service process
    # may still be writing when finish() returns: waited for until every key is in it (on a loaded machine the
    # summary's keys came after the config's).
    keys = (b"head_load_per_head/layer_00/head_01", b"head_load_balance/layer_00/busiest_head_vs_balanced",
            b"head_load_balance/final_load_entropy", b"moh/activated_fraction", b"moh/top_k")
    deadline = time.time() + 60
    while not all(key in (record := next(run_dir.glob("run-*.wandb")).read_bytes()) for key in keys) \
            and time.time() < deadline:
        time.sleep(0.2)
    for key in keys:
        assert key in record, key
    assert (run_dir / "files" / "head_load" / "loads.json").is_file()  # uploaded with the run


@pytest.mark.slow
def test_mlflow_sqlite_store_gets_step_images_metrics_params_and_text(tmp_path, monkeypatch, mlflow_uri_unset,
                                                                      mlflow_store):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)  # the store's artifacts go to ./mlruns
    uri = mlflow_store(tmp_path / "mlflow.db")  # the store MLflow 3 recommends (its file store is refused)
    logger = MLFlowLogger(experiment_name="moh-dashboards", tracking_uri=uri)
    fit_tiny(TinyTask(timesteps=True), logger, tmp_path)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(logger.run_id)
    assert run.data.params["moh/router"] == "learned" and float(run.data.params["moh/activated_fraction"]) == 0.875
    history = client.get_metric_history(logger.run_id, "head_load_per_head/layer_00/head_02")
    assert [m.step for m in history] == [2, 4, 6] and all(0 <= m.value <= 1 for m in history)
    assert 0 < run.data.metrics["head_load_balance/final_load_entropy"] <= 1
    artifacts = {a.path for a in client.list_artifacts(logger.run_id, "head_load")}
    assert {"head_load/summary.md", "head_load/loads.json", "head_load/loads_over_time.png"} <= artifacts
    images = [a.path for a in client.list_artifacts(logger.run_id, "images")]
    for key in ("head_load.heatmap_train", "head_load.heatmap_val", "head_load.per_class_layer_00",
                "head_load.per_timestep_layer_00"):
        assert any(path.startswith(f"images/{key}+step+") for path in images), key


def test_cards_stay_wide_and_readable():
    layers = [LayerLoad(index=i, num_heads=8, shared=2, top_k=4, load=[1, 1, .6, .7, .8, .5, .7, .7]) for i in range(6)]
    snapshot = HeadLoadSnapshot(step=10, epoch=0, split="validation", layers=layers)
    card = layer_card(snapshot)
    height, width, _ = card.shape
    assert width / height > 1.4  # TensorBoard's time series caps image height near 210 px
    group = GroupLoad(layer=5, kind="class", labels=[str(c) for c in range(10)], load=[[.6, .7, .8, .5, .7, .7]] * 10,
                      tokens=[1.0] * 10)
    height, width, _ = group_card(layers[5], group).shape
    assert width / height > 1.6
    assert load_entropy(np.array([0.5, 0.5, 0.5])) == pytest.approx(1.0) and load_entropy(np.array([1.0, 0, 0])) == 0


def test_diffusion_task_exposes_the_timesteps_it_drew():
    arch = DiTConfig(input_size=8, patch_size=4, in_chans=1, embed_dim=32, depth=2, num_heads=4, num_classes=3,
                     moh=MoHConfig(num_shared_heads=2, top_k=1))
    task = ClassConditionalDiffusion(arch, num_train_timesteps=100)
    assert task.last_timesteps is None
    task._diffusion_loss((torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1])))
    assert task.last_timesteps.shape == (5,) and 0 <= int(task.last_timesteps.min()) <= int(
        task.last_timesteps.max()) < 100


def test_hparams_columns_are_the_metrics_each_task_logs():
    from moh_lightning.callbacks.head_load.summary import hparam_metrics
    from moh_lightning.callbacks.sample_grid import SampleGridCallback
    from moh_lightning.tasks import ImageClassifier
    from moh_lightning.tasks.diffusion import ClassConditionalDiffusion

    entropy = "head_load_balance/final_load_entropy"
    assert hparam_metrics(ImageClassifier, []) == ("val/loss", "val/acc1", entropy)
    assert hparam_metrics(ClassConditionalDiffusion, [SampleGridCallback()]) == ("val/loss", entropy)
    assert hparam_metrics(ClassConditionalDiffusion, [SampleGridCallback(fid_num_samples=8)]) == (
        "val/loss", "samples/fid", "samples/sfid", entropy)


@pytest.mark.slow
def test_heatmaps_every_n_validations_and_windows_and_the_last_at_the_end(tmp_path):
    # Validations at steps 3, 6, 11 and 14 (8 batches an epoch): the first and every 2nd after it are drawn (not the
    # second), and the last once training ends, so the run folder's heatmaps are always the last validation's;
    # loads.json is written at every validation. Training windows end at steps 2, 4, ..., 14: by default the first and
    # every 10th are drawn, and the last when training ends.
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer = fit_tiny(TinyTask(), logger, tmp_path, max_steps=14, images_every_n_validations=2)
    events = EventAccumulator(trainer.log_dir, size_guidance={"images": 0}).Reload()
    for tag in ("head_load/heatmap_val", "head_load/per_class_layer_00"):
        assert [image.step for image in events.Images(tag)] == [3, 11, 14]
    assert HeadLoadSnapshot.load(Path(trainer.log_dir) / "head_load" / "loads.json").step == 14
    for tag in ("head_load/heatmap_train", "head_load/over_time_layer_00"):
        assert [image.step for image in events.Images(tag)] == [2, 14]

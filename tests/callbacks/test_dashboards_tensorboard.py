"""A real ``tensorboard`` process on a run of ``moh fit``: its HTTP data API serves the head-load heatmaps, the
custom-scalars layout, the summary text and the HParams with the run's real metrics (TensorBoard's plugin routes:
images/tags, images/images, images/individualImage, custom_scalars/layout, custom_scalars/scalars, text/tags,
text/text, hparams/experiment, hparams/session_groups, histograms/tags)."""
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from PIL import Image

from moh_lightning.cli import main

pytestmark = pytest.mark.server

# Two blocks, each a routed layer: a card each per window and validation.
SMOKE = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2",
         "--data.init_args.batch_size=32", "--trainer.log_every_n_steps=2", "--trainer.enable_progress_bar=false",
         "--trainer.enable_model_summary=false", "--model.init_args.arch.depth=2"]
RUN = "vit_tiny_mnist_75/version_0"
HPARAMS = {"moh/activated_fraction": 0.75, "moh/shared_heads": 2.0, "moh/top_k": 4.0, "moh/load_balance_beta": 0.01,
           "moh/router": "learned", "task": "ImageClassifier"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs/`` of one short ``moh fit`` of the embedded MNIST ViT (2 blocks, 4 steps, windows of 2, one
    validation)."""
    folder = tmp_path_factory.mktemp("dashboards")
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        main(["fit", "--config", "vit_tiny_mnist_75.yaml", *SMOKE])
    finally:
        os.chdir(cwd)
    return folder / "runs"


class TensorBoard:
    def __init__(self, logdir, load_fast: str) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port",
             str(port), "--load_fast", load_fast, "--reload_interval", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def raw(self, route: str, body: dict | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.read()

    def get(self, route: str, body: dict | None = None):
        return json.loads(self.raw(route, body))

    def wait(self, timeout: float = 60.0) -> None:
        """Until the server answers and has read the run's images and summary text."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tensorboard exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                if RUN in self.get("/data/plugin/images/tags") and RUN in self.get("/data/plugin/text/tags"):
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError("tensorboard did not serve the run in time")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=20)


def _query(**params) -> str:
    return urllib.parse.urlencode(params)


def test_real_tensorboard_serves_heatmaps_layout_summary_and_hparams_with_metrics(runs):
    # TensorBoard's Rust data server and its Python reader, started together: each spends its start waiting.
    boards = [TensorBoard(runs, load_fast) for load_fast in ("true", "false")]
    try:
        for board in boards:
            board.wait()
        for board in boards:
            _check_serves_the_run(board)
    finally:
        for board in boards:
            board.stop()


def _check_serves_the_run(board: TensorBoard) -> None:
    """What the HTTP data API of ``board`` serves of the run."""
    # Heatmap images: every window, every validation, and one per-class view per routed layer.
    tags = board.get("/data/plugin/images/tags")[RUN]
    expected = {"head_load/heatmap_train", "head_load/heatmap_val"} | {
        f"head_load/{view}_layer_{layer:02d}" for layer in range(2) for view in ("per_class", "over_time")}
    assert expected <= set(tags)
    assert tags["head_load/heatmap_train"]["samples"] == 1
    for tag in ("head_load/heatmap_val", "head_load/per_class_layer_01"):
        entries = board.get(f"/data/plugin/images/images?{_query(run=RUN, tag=tag, sample=0)}")
        assert [entry["step"] for entry in entries] == [4]
        png = board.raw(f"/data/plugin/images/individualImage?{entries[-1]['query']}")
        width, height = Image.open(io.BytesIO(png)).size
        assert width >= 560 and width / height > 1.4, (tag, width, height)
    # Histograms and Distributions: each routed layer's load ÷ even load, every window.
    histograms = board.get("/data/plugin/histograms/tags")[RUN]
    assert set(histograms) == {f"head_load_vs_even/layer_{layer:02d}" for layer in range(2)}
    entries = board.get(f"/data/plugin/histograms/histograms?{_query(run=RUN, tag='head_load_vs_even/layer_01')}")
    assert [entry[1] for entry in entries] == [2, 4]

    # Custom scalars: one chart per layer whose regex draws one line per routed head.
    layout = board.get("/data/plugin/custom_scalars/layout")
    charts = {chart["title"]: chart["multiline"]["tag"] for category in layout["category"]
              for chart in category["chart"]}
    assert [f"layer {layer:02d}: routed-head load (share of tokens)" in charts for layer in range(2)] == [True] * 2
    regex = charts["layer 01: routed-head load (share of tokens)"][0]
    answer = board.get(f"/data/plugin/custom_scalars/scalars?{_query(run=RUN, tag=regex)}")
    assert answer["regex_valid"]
    lines = answer["tag_to_events"]
    assert sorted(lines) == [f"head_load_per_head/layer_01/head_{head:02d}" for head in range(2, 8)]
    assert all(len(points) == 2 for points in lines.values())  # windows at steps 2 and 4
    for step in range(2):  # each token uses exactly top-4 of the 6 routed heads
        assert sum(points[step][2] for points in lines.values()) == pytest.approx(4.0, abs=1e-5)

    # The end-of-run summary, rendered from markdown by the text plugin.
    assert board.get("/data/plugin/text/tags")[RUN] == ["head_load/summary/text_summary"]
    text = board.get(f"/data/plugin/text/text?{_query(run=RUN, tag='head_load/summary/text_summary')}")
    html = text[-1]["text"]
    assert "<table>" in html and "<td>1</td>\n<td>2 shared + top-4 of 6 routed</td>" in html
    assert "most used routed head" in html and "Load of every head" in html

    # HParams: one vocabulary, and the run's final metrics (not hp_metric = -1).
    experiment = board.get("/data/plugin/hparams/experiment", {"experimentName": ""})
    names = {info["name"] for info in experiment["hparamInfos"]}
    assert set(HPARAMS) <= names
    metrics = {info["name"]["tag"] for info in experiment["metricInfos"]}
    assert metrics == {"val/acc1", "val/loss", "head_load_balance/final_load_entropy"}  # only what a ViT logs
    assert "hp_metric" not in metrics
    groups = board.get("/data/plugin/hparams/session_groups", {
        "experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                                  "STATUS_RUNNING"],
        "colParams": [], "startIndex": 0, "sliceSize": 10})["sessionGroups"]
    assert len(groups) == 1
    hparams = groups[0]["hparams"]
    for name, value in HPARAMS.items():
        assert hparams[name] == pytest.approx(value) if isinstance(value, float) else hparams[name] == value
    values = {metric["name"]["tag"]: metric["value"] for metric in groups[0]["metricValues"]}
    assert 0.0 <= values["val/acc1"] <= 1.0 and values["val/loss"] > 0
    assert 0.5 < values["head_load_balance/final_load_entropy"] <= 1.0

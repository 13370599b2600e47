"""A core install is the suite's three tasks: importing the package or running a ViT `moh fit` loads no integration,
and a command whose extra is missing stops in one line naming the extra."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moh_lightning.cli import COMMANDS, main

INTEGRATIONS = ("ray", "lm_eval", "mlflow", "wandb", "transformers", "datasets", "accelerate")


@pytest.mark.slow
def test_importing_the_package_moh_help_the_block_or_a_vit_fit_loads_no_integration_that_its_base_does_not(tmp_path):
    """Each step in one fresh Python process, each adding to what the last loaded: importing the package and `moh
    --help` load nothing (the help lists the commands without importing torch or any of them); the block and the
    named models add nothing to what timm loads (timm imports W&B where it is installed, ``timm.utils``, and a core
    install has none); Lightning imports torchmetrics, which imports transformers where it is installed, and a ViT
    `moh fit` adds nothing to what Lightning and timm load. That fit, a ``fast_dev_run``, has no run folder and writes
    nothing in the working folder."""
    lean = sorted({command.target.partition(":")[0] for command in COMMANDS.values()} | {"torch"})
    fit = ["fit", "--config", "vit_tiny_mnist_75.yaml", "--trainer.fast_dev_run", "1",
           "--trainer.enable_progress_bar", "false"]
    script = f"""import json, sys
def loaded():
    return sorted({{name.split(".")[0] for name in sys.modules}} & set({INTEGRATIONS!r}))
steps = {{}}
import moh_lightning
assert "torch" not in sys.modules
from moh_lightning.cli import main
main(["--help"])
assert not set({lean!r}) & set(sys.modules), set({lean!r}) & set(sys.modules)
steps["package and help"] = loaded()
import timm
steps["timm"] = loaded()
import moh_lightning.models
from moh_lightning import MoHAttention
steps["block"] = loaded()
import lightning.pytorch
steps["lightning"] = loaded()
main({fit!r})
steps["fit"] = loaded()
print(json.dumps(steps))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = json.loads(done.stdout.splitlines()[-1])
    assert steps["package and help"] == []
    assert steps["block"] == steps["timm"]
    assert steps["fit"] == steps["lightning"]
    assert sorted(path.name for path in tmp_path.iterdir()) == []


@pytest.mark.parametrize(("missing", "args", "extra"), [
    ("ray", ["sweep", "--fit_config", "vit_tiny_mnist_75.yaml"], "sweep"),
    ("lm_eval", ["lm-eval", "--checkpoint", "x.ckpt", "--tasks", "[arc_easy]"], "lm-eval"),
    ("wandb", ["fit", "--config", "vit_tiny_mnist_75.yaml", "--trainer.logger", "WandbLogger"], "loggers"),
])
@pytest.mark.slow
def test_a_command_whose_extra_is_missing_names_the_extra_in_one_line(missing, args, extra, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m.startswith(f"{missing}.")]:  # loaded by an earlier test
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # what `import <missing>` meets where it is not installed
    # With the sweep package's submodules: imported already, they would hand the command over without Ray.
    for name in [m for m in sys.modules if m in ("moh_lightning.sweep", "moh_lightning.tools.lm_eval")
                 or m.startswith("moh_lightning.sweep.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    message = str(exit_info.value.code)
    assert "\n" not in message and f"pip install 'moh-lightning[{extra}]'" in message and missing in message

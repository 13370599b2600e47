"""A core install is the suite's three tasks: importing the package or running a ViT `moh fit` loads no integration,
and a command whose extra is missing stops in one line naming the extra."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moh_lightning.cli import COMMANDS, main

INTEGRATIONS = ("ray", "lm_eval", "mlflow", "wandb", "transformers", "datasets", "accelerate")


def _integrations_loaded(code: str, cwd=None) -> list[str]:
    """The integrations a fresh Python process has imported after running ``code``."""
    script = f"import sys\n{code}\nimport json\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & " \
             f"set({INTEGRATIONS!r}))))"
    done = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_importing_the_package_or_moh_help_loads_nothing_and_the_block_no_integration_that_timm_does_not():
    """timm imports W&B where it is installed (``timm.utils``), and a core install has none; the block and the named
    models add nothing to what timm loads. `moh --help` lists the commands without importing torch or any of them."""
    lean = sorted({command.target.partition(":")[0] for command in COMMANDS.values()} | {"torch"})
    assert _integrations_loaded("import moh_lightning\nassert 'torch' not in sys.modules\n"
                                "from moh_lightning.cli import main\nmain(['--help'])\n"
                                f"assert not set({lean!r}) & set(sys.modules), set({lean!r}) & set(sys.modules)") == []
    timms = _integrations_loaded("import timm")
    block = _integrations_loaded("import moh_lightning.models\nfrom moh_lightning import MoHAttention")
    assert set(block) <= set(timms)


@pytest.mark.slow
def test_a_vit_fit_loads_no_integration_that_lightning_does_not(tmp_path):
    """Lightning imports torchmetrics, which imports transformers where it is installed (a core install has none);
    `moh fit` adds nothing to what Lightning and timm load."""
    lightnings = _integrations_loaded("import lightning.pytorch, timm")
    fit = _integrations_loaded("from moh_lightning.cli import main\nmain(['fit', '--config', 'vit_tiny_mnist_75.yaml', "
                               "'--trainer.fast_dev_run', '1', '--trainer.enable_progress_bar', 'false'])",
                               cwd=tmp_path)
    assert set(fit) <= set(lightnings)


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

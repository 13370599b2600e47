"""Bad configuration and missing files stop `moh` with one line that names the key or file and what to do."""
from urllib.error import URLError

import numpy as np
import pytest

from moh_lightning.cli import main
from moh_lightning.data.latents import LatentDataModule
from moh_lightning.metrics.fidelity import InceptionWeightsMissing, compute_fidelity


def _error(call) -> str:
    with pytest.raises(SystemExit) as exit_info:
        call()
    message = str(exit_info.value.code)
    assert exit_info.value.code not in (0, None) and "\n" not in message, message
    return message


@pytest.mark.parametrize(("override", "key"), [
    (["--model.init_args.arch.moh.top_kk", "3"], "'model.init_args.arch.moh.top_kk'"),  # mistyped key in a subclass
    (["--trainer.max_step", "3"], "'trainer.max_step'"),                      # an abbreviation is not max_steps
    (["--trainer.max_steps", "three"], "'trainer.max_steps'"),                # wrong type
])
def test_bad_config_key_is_one_line_naming_the_key(override, key, run_dir, capsys):
    message = _error(lambda: main(["fit", "--config", "vit_tiny_mnist_75.yaml", *override]))
    assert key in message
    assert "usage:" not in capsys.readouterr().err  # no usage text before the line


@pytest.mark.parametrize(("config", "flag", "said"), [
    ("vit_s_75.yaml", "--data.init_args.data_dir", ["train/<class>/ and val/<class>/", "vit_tiny_mnist_75.yaml",
                                                    "vit_tiny_folder_digits_75.yaml"]),
    ("dit_b2_75.yaml", "--data.init_args.data_path", ["<class>/ image folders", "dit_mnist_75.yaml",
                                                      "dit_folder_90.yaml"]),
])
@pytest.mark.slow
def test_a_config_without_its_data_names_the_flag_the_layout_and_a_cpu_sized_run(config, flag, said, run_dir):
    """`moh fit --config vit_s_75.yaml` without ImageNet once said "config key 'data': the following arguments are
    required: data_dir"."""
    message = _error(lambda: main(["fit", "--config", config]))
    assert message.startswith(f"moh: {flag} is required by ")
    assert all(text in message for text in said), message


def test_a_tool_without_a_required_option_names_the_flag():
    assert _error(lambda: main(["sample"])) == "moh sample: --checkpoint is required; `moh sample --help` describes it."


def test_mistyped_key_in_a_yaml_is_one_line(run_dir):
    (run_dir / "typo.yaml").write_text("model:\n  init_args:\n    learning_rate: 0.1\n")
    message = _error(lambda: main(["fit", "--config", "vit_tiny_mnist_75.yaml", "--config", "typo.yaml"]))
    assert "'model.init_args.learning_rate'" in message and "--print_config" in message


def test_impossible_head_budget_is_one_line_naming_the_budget(run_dir):
    message = _error(lambda: main(["fit", "--config", "vit_tiny_mnist_75.yaml",
                                   "--model.init_args.arch.moh.top_k", "7"]))
    assert "top_k=7" in message and "6 routed heads" in message


def test_missing_dit_data_path_names_the_key_and_folder(tmp_path):
    data = LatentDataModule(data_path=str(tmp_path / "imagenet" / "train"), cache_dir=str(tmp_path / "cache"))
    message = _error(data.prepare_data)
    assert "data.init_args.data_path" in message and str(tmp_path / "imagenet" / "train") in message


def test_missing_vae_names_the_key_and_the_local_folder_option(tmp_path, write_image_folder):
    write_image_folder(tmp_path / "images", per_class=1)
    data = LatentDataModule(data_path=str(tmp_path / "images" / "train"), cache_dir=str(tmp_path / "cache"),
                            vae=str(tmp_path / "no_vae_here"), image_size=32)
    message = _error(data.prepare_data)
    assert "data.init_args.vae" in message and "no_vae_here" in message and "local folder" in message


def test_inception_weights_unreachable_offline_names_the_weights_option(monkeypatch):
    def offline(*args, **kwargs):
        raise URLError("[Errno -2] Name or service not known")

    # torch-fidelity downloads the weights with torch.hub when no --weights file is given.
    monkeypatch.setattr("torch_fidelity.feature_extractor_inceptionv3.load_state_dict_from_url", offline)
    monkeypatch.setenv("TORCH_HOME", "/nonexistent/torch_home")  # no cached copy either
    images = np.zeros((2, 32, 32, 3), np.uint8)
    with pytest.raises(InceptionWeightsMissing) as missing:  # one line from `moh` (cli.user_error), and the tool's
        compute_fidelity(images, images)
    message = str(missing.value)
    assert "\n" not in message
    assert "--weights" in message and "weights-inception-2015-12-05-6726825d.pth" in message


def test_missing_inception_weights_file_names_the_file(tmp_path):
    images = np.zeros((2, 32, 32, 3), np.uint8)
    message = _error(lambda: compute_fidelity(images, images, weights=str(tmp_path / "inception.pth")))
    assert "--weights" in message and "inception.pth" in message


def test_a_yaml_value_without_a_space_after_its_colon_says_so(run_dir):
    """`'[{path:my.txt}]'` is YAML for the key 'path:my.txt' with no value: the line says to write `path: my.txt`
    rather than only that the key is unknown."""
    message = _error(lambda: main(["fit", "--config", "llm_stdlib_75.yaml", "--data.init_args.sources",
                                   "[{path:my.txt}]"]))
    assert "'data.init_args.sources.path:my.txt'" in message and "a space after the colon" in message

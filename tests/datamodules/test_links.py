"""num_classes, vocab_size and in_chans reach the model from the data (LightningCLI link_arguments)."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from moh_lightning.trainer_cli import MoHLightningCLI


def _cli(*args: str) -> MoHLightningCLI:
    return MoHLightningCLI(args=[*args, "--trainer.accelerator", "cpu", "--trainer.logger", "false"], run=False)


def test_classes_and_channels_come_from_the_folder(run_dir):
    for split in ("train", "val"):
        for label in ("a", "b", "c"):
            (run_dir / split / label).mkdir(parents=True)
            Image.fromarray(np.zeros((32, 32), np.uint8), mode="L").save(run_dir / split / label / "0.png")
    # the recipe says num_classes 10 and in_chans 1; the folder has 3 classes and is read as RGB here
    cli = _cli("--config", "vit_tiny_folder_digits_75.yaml", "--data.init_args.data_dir", str(run_dir),
               "--data.init_args.in_chans", "3", "--data.init_args.mean", "null", "--data.init_args.std", "null")
    arch = cli.model.hparams.arch
    assert (arch["num_classes"], arch["in_chans"]) == (3, 3)
    assert cli.model.model.head.out_features == 3 and cli.model.model.patch_embed.proj.in_channels == 3


def test_vocab_size_comes_from_the_tokenizer(run_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<eos>", "<unk>", "a", "b"])},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>").save_pretrained(
        run_dir / "tok")
    cli = _cli("--config", "llm_stdlib_75.yaml", "--data.init_args.tokenizer", str(run_dir / "tok"))
    assert cli.model.hparams.arch["vocab_size"] == 4  # the recipe says 259 (the byte tokenizer's)
    assert _cli("--config", "llm_stdlib_75.yaml").model.hparams.arch["vocab_size"] == 259


@pytest.mark.slow
def test_links_skip_what_a_task_or_data_module_lacks(run_dir):
    # DiT: the MNIST pixel module has num_classes, no vocab_size / in_chans; DiTConfig has no vocab_size
    assert _cli("--config", "dit_mnist_75.yaml").model.hparams.arch["num_classes"] == 10
    # the MNIST module: 10 classes, one channel; ImageNet's folder absent: the config's values stay
    assert _cli("--config", "vit_tiny_mnist_75.yaml").model.hparams.arch["num_classes"] == 10
    cli = _cli("--config", "vit_s_75.yaml", "--data.init_args.data_dir", str(run_dir / "missing"))
    assert cli.model.hparams.arch["num_classes"] == 1000

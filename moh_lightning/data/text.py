"""Packed token sequences for causal LM training, from local text and Hugging Face ``datasets`` mixed by ratio.

The sources (``text_sources``) are tokenised once into memory-mapped token arrays (``token_arrays``), from which the
data module serves fixed-length windows (``text_datasets``).

Tokeniser: any Hugging Face tokenizer by name or path, or ``byte`` (``moh_lightning.data.tokenizers``).
"""
from __future__ import annotations

from pathlib import Path

from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from moh_lightning.data.loaders import train_loader
from moh_lightning.data.text_datasets import EvenChunks, MixtureSequences, Prompts
from moh_lightning.data.text_sources import STDLIB, TextSource
from moh_lightning.data.token_arrays import (
    SPLIT_RULES,
    SplitRule,
    describe,
    how_split,
    is_validation,
    open_tokens,
    tokenize_source,
)
from moh_lightning.data.tokenizers import BYTE_TOKENIZER, RUN_TOKENIZER, load_tokenizer
from moh_lightning.errors import BadValueError
from moh_lightning.value_checks import check_numbers


class TextDataModule(LightningDataModule):
    """Packed next-token sequences from a weighted mixture of text sources.

    Args:
        sources: The corpora and their sampling weights; the Python standard library when None.
        tokenizer: ``byte`` or a Hugging Face tokenizer name / folder.
        seq_len: Tokens per training sequence (each sample holds ``seq_len + 1`` for the shifted target).
        batch_size: Sequences per micro-batch (the token batch is reached with the Trainer's
            ``accumulate_grad_batches``).
        num_workers: DataLoader workers.
        cache_dir: Where token arrays are written; ``~/.cache/moh_lightning/text`` when None.
        samples_per_epoch: Training windows per epoch; every source's chunk count summed when None.
        val_samples: Validation windows, spread evenly over the held-out documents; all when None.
        seed: Seed of the mixture draw.
        split_by: How every source holds out its ``val_fraction``: ``documents`` (whole files or rows, by a hash of
            their names), ``tokens`` (the last ``val_fraction`` of the source's tokens, one contiguous block, so no
            window straddles training and validation), or ``auto``: by documents unless that leaves the training or
            the validation side of a source without a document (a single text file), then by tokens.
        predict_prompts: A text file of prompts, one a line, that ``moh predict`` continues (one at a time, as
            prompts differ in length); the sources are not read then.
    """

    def __init__(
            self,
            sources: list[TextSource] | None = None,
            tokenizer: str = BYTE_TOKENIZER,
            seq_len: int = 2048,
            batch_size: int = 8,
            num_workers: int = 0,
            cache_dir: str | None = None,
            samples_per_epoch: int | None = None,
            val_samples: int | None = 512,
            seed: int = 0,
            split_by: SplitRule = "auto",
            predict_prompts: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_numbers(self.hparams, "data.init_args")
        if split_by not in SPLIT_RULES:
            raise ValueError(f"data.init_args.split_by={split_by!r}: choose one of {', '.join(SPLIT_RULES)}.")
        self.split_by = split_by
        self.sources = list(sources) if sources else [TextSource(path=STDLIB, pattern="*.py")]
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache/moh_lightning/text"
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self._tokenizer = None
        self._folders: list[Path] | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.hparams.tokenizer, key="data.init_args.tokenizer")
        return self._tokenizer

    def keep_in_run_folder(self, run: Path) -> dict[str, str]:
        """A tokenizer read from a local folder is saved into the run folder (``tokenizer/``, by transformers'
        ``save_pretrained``) and read from there on, by its absolute path, which the run's checkpoints and config.yaml
        then record: the run's tools, evaluations and resumes need neither the folder it came from nor the working
        folder it was named from. Returns the settings changed so (``{"tokenizer": ...}``); ``byte`` and hub ids stay
        as named, and a tokenizer already in the run folder (a resumed run's) is not written again."""
        name = self.hparams.tokenizer
        kept = (run / RUN_TOKENIZER).resolve()
        if name == BYTE_TOKENIZER or not Path(name).expanduser().is_dir() or Path(name).expanduser().resolve() == kept:
            return {}
        if not kept.exists():
            self.tokenizer.save_pretrained(kept)
        self.hparams.tokenizer = str(kept)
        return {"tokenizer": str(kept)}

    @property
    def vocab_size(self) -> int:
        """The tokenizer's size; linked into ``model.init_args.arch.vocab_size`` by ``moh``.

        When the tokenizer cannot be loaded there is no such attribute (``AttributeError``), so the link keeps
        the config's value and ``prepare_data`` stops with the tokenizer's one-line message.
        """
        try:
            return len(self.tokenizer)
        except OSError as error:
            raise AttributeError(f"vocab_size: {error}") from None

    @property
    def is_byte_level(self) -> bool:
        """Every token but EOS is one UTF-8 byte, so nats per token convert directly to bits per byte."""
        return self.hparams.tokenizer == BYTE_TOKENIZER

    def prepare_data(self) -> None:
        if self.trainer is not None and self.trainer.state.fn == TrainerFn.PREDICTING:
            return  # the prompts alone: the corpus need not be on this machine
        self._folders = self._tokenize()

    def _tokenize(self) -> list[Path]:
        return [tokenize_source(s, self.hparams.tokenizer, self.cache_dir, key="data.init_args.tokenizer",
                                split_by=self.split_by, tokenizer=self.tokenizer) for s in self.sources]

    def setup(self, stage: str) -> None:
        if stage == "predict":  # the prompts alone
            return
        # In one process prepare_data has just checked the entries; other ranks check them here.
        folders = self._folders or self._tokenize()
        for source, folder in zip(self.sources, folders, strict=True):
            rank_zero_info(describe(source, folder))
        seq_len = self.hparams.seq_len
        train = [open_tokens(f, "train") for f in folders]
        for source, folder, tokens in zip(self.sources, folders, train, strict=True):
            if len(tokens) <= seq_len:
                raise BadValueError(f"data source {source.label!r}: its training split has {len(tokens)} tokens, fewer "
                                 f"than one sequence of data.init_args.seq_len + 1 = {seq_len + 1}{how_split(folder)}; "
                                 f"add text, lower seq_len, or remove the source.")
        num_samples = self.hparams.samples_per_epoch or max(1, sum((len(a) - 1) // seq_len for a in train))
        self.train_set = MixtureSequences(train, [s.weight for s in self.sources], seq_len, num_samples,
                                          self.hparams.seed)
        self.val_set = EvenChunks([open_tokens(f, "val") for f in folders], seq_len, self.hparams.val_samples)
        if len(self.val_set) == 0:
            held_out = ", ".join(f"{s.label!r} holds out {len(open_tokens(f, 'val'))} tokens{how_split(f)}"
                                 for s, f in zip(self.sources, folders, strict=True))
            raise BadValueError(f"no validation sequence of data.init_args.seq_len + 1 = {seq_len + 1} tokens: "
                             f"{held_out}; raise a source's val_fraction, add documents, or lower seq_len.")

    def train_dataloader(self) -> StatefulDataLoader:
        return train_loader(self.train_set, self.hparams.batch_size, self.hparams.num_workers, self.trainer)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, shuffle=False,
                          num_workers=self.hparams.num_workers)

    def predict_problem(self) -> str | None:
        """Why ``moh predict`` cannot run with these settings, in one line; None when it can."""
        prompts = self.hparams.predict_prompts
        if prompts is None:
            return ("no prompts to continue: pass --data.init_args.predict_prompts <file> (a text file, one prompt a "
                    "line).")
        path = Path(prompts).expanduser()
        if not path.is_file():
            return f"data.init_args.predict_prompts={prompts!r}: no such file; give a text file, one prompt a line."
        if not path.read_text(encoding="utf-8").strip():
            return f"data.init_args.predict_prompts={prompts!r}: no prompt in it; write one prompt a line."
        return None

    def predict_dataloader(self) -> DataLoader:
        problem = self.predict_problem()
        if problem:
            raise ValueError(problem)
        prompts = Prompts(Path(self.hparams.predict_prompts).expanduser(), self.tokenizer)
        return DataLoader(prompts, batch_size=1, num_workers=self.hparams.num_workers)


# The text data's public names, importable from here as before the sources, token arrays and datasets had modules.
__all__ = ["STDLIB", "EvenChunks", "MixtureSequences", "Prompts", "TextDataModule", "TextSource", "describe",
           "is_validation", "tokenize_source"]

"""Causal language modelling with a MoH-LLaMA decoder: the paper's LLM recipe (section 4.3, Tab. C / D).

AdamW (weight decay 0.1 on matrices and embeddings, none on norms), linear warm-up from ``warmup_lr``
then cosine decay to ``min_lr`` over the token budget, load-balance loss beta 0.01 with the learned router and 0
with the query-norm router (see ``load_balance_beta``). Gradient clipping (1.0),
bf16 and gradient accumulation are Trainer settings in the configs. Training stops once ``max_tokens``
tokens have been consumed; the trainer's ``max_steps`` (the progress bar's total) is set from that budget when
training starts. Loss, perplexity and, for the byte tokenizer, bits per byte are logged.

With ``init_from`` the network is the pretrained ``transformers`` model itself (any family whose attention goes
through transformers' attention interface, ``models.hf_causal``), its architecture and every setting read from the
source's config before anything is built (paper section 4.4: continue-tuning a pretrained model into MoH).
"""
from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any, Literal

import torch

from moh_lightning import lightning_compat as compat
from moh_lightning.data.tokenizers import BYTE_TOKENIZER
from moh_lightning.errors import BadValueError
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.hf_causal import (
    build_hf_causal,
    family_config,
    head_budget,
    query_heads,
    read_source_config,
)
from moh_lightning.models.llama import LlamaConfig, MoHLlama
from moh_lightning.tasks.base import MoHTask, init_from_option, weight_decay_groups
from moh_lightning.value_checks import check_numbers

#: The checkpoint's key for the optimizer steps its learning-rate schedule spans (``schedule_change``).
SCHEDULE_STEPS = "schedule_steps"
# LlamaConfig's fields -> the transformers config's, for the shapes and settings a source gives (``check_arch``).
_SOURCE_FIELDS = {"depth": "num_hidden_layers", "embed_dim": "hidden_size", "num_heads": "num_attention_heads",
                  "head_dim": "head_dim", "num_kv_heads": "num_key_value_heads",
                  "intermediate_size": "intermediate_size", "block_size": "max_position_embeddings",
                  "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}
#: What ``not_the_sources`` calls the source's value: its config's field, or where ``source_arch`` reads it.
_SOURCE_NAMES = {**_SOURCE_FIELDS, "rope_base": "rope_theta", "layer_heads": "its attention layers' query heads"}


def complete(model: torch.nn.Module, prompt_ids: list[int], tokenizer, max_new_tokens: int, temperature: float,
             top_k_tokens: int | None, top_p: float, seed: int, num_samples: int = 1) -> list[str]:
    """``num_samples`` continuations of a prompt's token ids by a language model (the suite's network or a transformers
    one in ``HFCausalLM``), decoded through the KV cache until the tokenizer's EOS: the text after the prompt, special
    tokens dropped."""
    idx = torch.tensor([prompt_ids] * num_samples, device=next(model.parameters()).device)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k_tokens=top_k_tokens, top_p=top_p,
                         eos_id=tokenizer.eos_token_id, seed=seed)
    return [tokenizer.decode(row[len(prompt_ids):].tolist(), skip_special_tokens=True) for row in out]


class LanguageModel(MoHTask):
    """Trains a (MoH) LLaMA decoder on next-token prediction.

    The decoder is built in ``configure_model`` (Lightning calls it before the strategy wraps the module, and
    ``load_from_checkpoint`` calls it too), so an 8B model is created once, in the precision plugin's dtype
    (``bf16-true`` builds it in bf16), with its pretrained weights, right before FSDP shards it block by block.

    Args:
        arch: The architecture, including the MoH head budget (``arch.moh``). With ``init_from`` only ``arch.moh``
            applies (``router: query_norm``; its budget, else the source's ``moh_*`` one, else half of each layer's
            heads shared and half the routed ones kept, ``models.hf_causal.head_budget``; a per-layer list has one
            entry per attention layer, ``arch.layer_heads``; ``moh: null`` tunes densely), and a shape or setting
            that differs from the source's stops the run naming it.
        init_from: A ``transformers`` causal LM (folder or hub id; a ``moh convert-hf`` / ``export-hf`` /
            ``convert-llama`` folder too) to continue-tune: the network is that model, with MoH attention.
        lr: Maximum learning rate.
        min_lr: Learning rate at the end of the cosine decay.
        warmup_lr: Learning rate at the first step of the linear warm-up.
        warmup_steps: Optimizer steps of linear warm-up.
        max_tokens: Training budget in tokens; sets the cosine length and stops training once reached.
        weight_decay: AdamW weight decay (not applied to norm gains).
        betas: AdamW betas.
        load_balance_beta: Weight beta of the load-balance loss (paper Eq. 8). None: 0.01 with the learned router,
            the authors' ViT / DiT weight of E * sum_i f_i P_i carried over to LMs (their LM training code is
            unreleased); 0 with ``router: query_norm``, as the authors' released MoH-LLaMA3, which computes no
            load-balance loss. A value > 0 adds the suite's E * sum_i f_i P_i of the query-norm scores.
        compile: ``auto`` (regional compilation on CUDA, eager on the CPU), ``true`` or ``false`` (``MoHTask``).
        activation_checkpointing: Recompute each block's activations in backward: less memory, about a third more
            compute per step.
        compile_kwargs: Keyword arguments of ``torch.compile`` where ``compile`` compiles, e.g. ``{mode:
            reduce-overhead}`` (CUDA graphs) or ``{backend: aot_eager}`` (``MoHTask``).
        init_from_hf: ``init_from``'s name before the release that gave every task one name; warns.
        hf_config: The ``transformers`` config of ``init_from``, read from it when None; checkpoints keep it, so a
            run resumes and its checkpoint loads without the source.
        max_new_tokens: ``moh predict``: tokens to generate after each prompt (fewer at EOS or a full context).
        temperature: ``moh predict``: softmax temperature of the sampler; 0 is greedy decoding.
        top_k_tokens: ``moh predict``: sample among the k most likely tokens; None for all.
        top_p: ``moh predict``: nucleus sampling mass; 1.0 turns it off.

    The four generation settings say how one ``moh predict`` decodes, not what the model is: they are not saved with
    the checkpoint, whose hyper-parameters LightningCLI would otherwise put over the command line's.
    """

    head_load_group_name = "source"

    @property
    def hparam_metrics(self) -> tuple[str, ...]:
        """Bits per byte where the tokenizer is byte-level (``validation_step`` logs it only there), else perplexity;
        read once a trainer runs the task."""
        byte_level = getattr(self.trainer.datamodule, "is_byte_level", False)
        return ("val/loss", "val/bpb" if byte_level else "val/ppl")

    def __init__(
            self,
            arch: LlamaConfig,
            init_from: str | None = None,
            lr: float = 3e-4,
            min_lr: float = 3e-5,
            warmup_lr: float = 1e-7,
            warmup_steps: int = 2000,
            max_tokens: int = 100_000_000_000,
            weight_decay: float = 0.1,
            betas: tuple[float, float] = (0.9, 0.95),
            load_balance_beta: float | None = None,
            init_from_hf: str | None = None,
            max_new_tokens: int = 200,
            temperature: float = 0.8,
            top_k_tokens: int | None = 50,
            top_p: float = 1.0,
            compile: bool | Literal["auto"] = "auto",
            activation_checkpointing: bool = False,
            compile_kwargs: dict[str, Any] | None = None,
            hf_config: dict | None = None,
    ) -> None:
        config = arch if isinstance(arch, LlamaConfig) else LlamaConfig(**arch)
        init_from = init_from_option(init_from, init_from_hf, "init_from_hf")
        if init_from is not None and hf_config is None:
            hf_config = read_source_config(init_from)  # config.json only: the shapes before anything is built
        if hf_config is not None:
            check_arch(config, hf_config, init_from or "the checkpoint's source")
            if config.moh is not None:
                head_budget(config.moh, family_config(hf_config))  # the budget checked before anything is built
        elif config.layer_heads is not None:  # MoHLlama has num_heads in every layer: a list would go unread
            raise BadValueError(f"model.init_args.arch.layer_heads={config.layer_heads}: only a pretrained source "
                                f"(init_from) has layers with heads of their own number; remove it.")
        if load_balance_beta is None:
            load_balance_beta = 0.0 if config.moh is not None and config.moh.router == "query_norm" else 0.01
        super().__init__(load_balance_beta, compile, activation_checkpointing, compile_kwargs)
        if max_tokens <= 0:
            raise ValueError(f"model.init_args.max_tokens={max_tokens} must be > 0.")
        if lr <= 0:  # the schedule is a multiple of lr, and a run that cannot move its weights is no training
            raise BadValueError(f"model.init_args.lr={lr} must be > 0; give a positive learning rate (`moh validate` "
                                f"scores a model without training it).")
        if not 0 <= min_lr <= lr:
            raise ValueError(f"model.init_args.min_lr={min_lr} must be between 0 and lr={lr}.")
        self.generation = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k_tokens": top_k_tokens,
                           "top_p": top_p}
        self.save_hyperparameters(ignore=list(self.generation))  # not saved: see the class's docstring
        if hf_config is not None:
            # The network is the source's: its config and its vocabulary, whose embedding may have more rows than the
            # tokenizer's size the data module links into arch.vocab_size. Saved again, so that the logged
            # hyper-parameters (hparams.yaml) are the checkpoint's.
            config = replace(config, vocab_size=family_config(hf_config).vocab_size)
            arch = self.hparams.arch
            arch = {**arch, "vocab_size": config.vocab_size} if isinstance(arch, dict) else config
            self.save_hyperparameters({**self.hparams, "arch": arch, "hf_config": hf_config})
        check_numbers({**self.hparams, **self.generation}, "model.init_args")
        self.init_from = init_from
        self.hf_config = hf_config
        # LightningCLI records the dataclass as a dict in hparams; the module keeps the typed config.
        self.config = config
        self.tokens_seen = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def example_input(self) -> torch.Tensor:
        data = getattr(compat.attached_trainer(self), "datamodule", None)
        length = self.model.block_size
        if data is not None and hasattr(data, "hparams") and "seq_len" in data.hparams:
            length = min(length, data.hparams.seq_len)  # a pretrained model's context can be far longer than training's
        return torch.zeros(1, length, dtype=torch.long)

    def setup(self, stage: str) -> None:
        data_vocab = getattr(self.trainer.datamodule, "vocab_size", None)
        if self.hf_config is not None:
            vocab = family_config(self.hf_config).vocab_size
            tokenizer = getattr(self.trainer.datamodule, "hparams", {}).get("tokenizer")
            if tokenizer == BYTE_TOKENIZER and self.init_from:
                # The data module's default: a pretrained model reads its own tokenizer's ids, not bytes.
                raise BadValueError(f"data.init_args.tokenizer={tokenizer}: continue-tuning {self.init_from} needs its "
                                    f"tokenizer; add --data.init_args.tokenizer {self.init_from}.")
            if isinstance(data_vocab, int) and data_vocab > vocab:
                raise BadValueError(f"data.init_args.tokenizer has {data_vocab} tokens, more than the {vocab} of "
                                    f"init_from's embedding: give init_from's own tokenizer.")
        elif isinstance(data_vocab, int) and data_vocab > self.config.vocab_size:
            raise ValueError(f"model.init_args.arch.vocab_size={self.config.vocab_size} is smaller than the "
                             f"tokenizer's {data_vocab} tokens: set it to at least {data_vocab}.")

    def configure_model(self) -> None:
        # Called again by each fit / validate and by callbacks (EMA): build once.
        if self.model is None:
            if self.hf_config is None:
                self.model = MoHLlama(self.config)
            else:
                # A fit, validation or test without a checkpoint starts from the pretrained weights (so `moh validate`
                # scores the source); a resumed run, an evaluated checkpoint and load_from_checkpoint restore theirs.
                fresh = self.init_from and compat.attached_trainer(self) is not None and not self.restores_checkpoint
                self.model = build_hf_causal(self.hf_config, self.config.moh, self.init_from if fresh else None)
        super().configure_model()  # activation checkpointing / torch.compile (MoHTask), once

    def head_load_groups(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The mixture source of each sequence: head use is compared across corpora."""
        return batch.get("source")

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = batch["tokens"]
        # The model takes the targets so that, with its fused kernels, it never forms the (B, T, V) logits.
        return self.model(tokens[:, :-1], targets=tokens[:, 1:])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        lm_loss = self._loss(batch)
        loss = self.with_load_balance(lm_loss)
        self.tokens_seen += batch["tokens"][:, 1:].numel() * self.trainer.world_size
        # Set here rather than in on_train_batch_end, which runs after the callbacks: StepCheckpoint then knows
        # this is the last batch and writes `last` at its end.
        if self.tokens_seen >= self.hparams.max_tokens:
            self.trainer.should_stop = True
        self.log("train/loss", lm_loss)
        self.log("train/ppl", lm_loss.exp())
        self.log("train/tokens", float(self.tokens_seen))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        # Means over ranks, so every rank's checkpoint callback monitors the same val/loss.
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", loss.exp(), sync_dist=True)
        if getattr(self.trainer.datamodule, "is_byte_level", False):
            self.log("val/bpb", loss / math.log(2), sync_dist=True)
        self.log("val/tokens", float(self.tokens_seen))

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict:
        """Continues one prompt (a batch of one: prompts differ in length) with the generation settings above, as
        ``moh generate --seed 0`` continues it; the completion's text, and the prompt's index."""
        completions = self.complete(batch["tokens"][0].tolist(), self.trainer.datamodule.tokenizer, seed=0,
                                    **self.generation)
        return {"index": batch["index"], "completions": completions}

    @torch.no_grad()
    def complete(self, prompt_ids: list[int], tokenizer, max_new_tokens: int, temperature: float,
                 top_k_tokens: int | None, top_p: float, seed: int, num_samples: int = 1) -> list[str]:
        """``complete`` with this task's network."""
        return complete(self.model, prompt_ids, tokenizer, max_new_tokens, temperature, top_k_tokens, top_p, seed,
                        num_samples)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen
        try:
            trainer = self.trainer
        except RuntimeError:  # saved by a trainer it was never attached to (``strategy.connect``): no schedule ran
            return
        if trainer.datamodule is not None:
            checkpoint[SCHEDULE_STEPS] = self.total_steps()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokens_seen = checkpoint.get("tokens_seen", 0)

    def on_train_start(self) -> None:
        # The token budget ends training, so it also bounds the trainer's steps, which the configs leave unlimited
        # (-1): the progress bar then counts (and times) the budget's steps instead of a whole epoch of windows.
        loop = self.trainer.fit_loop
        budget = self.total_steps()
        loop.epoch_loop.max_steps = budget if loop.max_steps == -1 else min(loop.max_steps, budget)

    def total_steps(self, data=None, trainer=None) -> int:
        """Optimizer steps in the token budget, from the data module's batch shape and the accumulation; the attached
        trainer's and data module's unless given."""
        trainer = trainer or self.trainer
        data = data or trainer.datamodule
        tokens_per_step = (data.hparams.batch_size * data.hparams.seq_len * trainer.accumulate_grad_batches
                           * trainer.world_size)
        return max(1, math.ceil(self.hparams.max_tokens / tokens_per_step))

    def schedule(self, total_steps: int):
        """The learning rate at each optimizer step of a run of ``total_steps``."""
        return warmup_cosine(self.hparams.lr, self.hparams.min_lr, self.hparams.warmup_lr, self.hparams.warmup_steps,
                             total_steps)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(weight_decay_groups(self.model, self.hparams.weight_decay),
                                      lr=self.hparams.lr, betas=tuple(self.hparams.betas))
        schedule = self.schedule(self.total_steps())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step) / self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def schedule_change(self, checkpoint: dict, data, trainer) -> str | None:
        """What resuming ``checkpoint`` with this budget and batch shape (``data``, ``trainer``) does to the learning
        rate, as a clause of the resume's line; None where nothing. The restored scheduler keeps its step and takes
        this run's length, so a larger ``max_tokens`` stretches the cosine and moves the learning rate at once."""
        saved = (checkpoint.get("lr_schedulers") or [None])[0]
        if saved is None:
            return None
        before, now = checkpoint.get(SCHEDULE_STEPS), self.total_steps(data, trainer)
        step, lr_before = saved["last_epoch"], saved["_last_lr"][0]
        lr_now = self.schedule(now)(step)
        if before == now or before is None and math.isclose(lr_before, lr_now, rel_tol=1e-6):
            return None
        length = f"{now} steps" + (f", not {before}" if before is not None else "")
        return f"the learning-rate schedule now spans {length}: lr at step {step} {lr_before:.2g} -> {lr_now:.2g}"


def check_arch(config: LlamaConfig, hf_config: dict, source: str) -> None:
    """With ``init_from`` the architecture is the source's (``source_arch``): ``arch`` may leave a shape or setting at
    its default or repeat the source's value, and any other value stops here in one line naming it (the vocabulary
    follows the tokenizer, checked in ``setup``)."""
    network = source_arch(hf_config)
    defaults = LlamaConfig()
    for field in fields(LlamaConfig):
        name = field.name
        if name in ("moh", "vocab_size", "fused_kernels"):  # budget and vocabulary checked apart; kernels: speed
            continue
        value, theirs = getattr(config, name), network.get(name)
        if value != getattr(defaults, name) and value != theirs:
            raise BadValueError(not_the_sources(name, value, theirs, source))


def not_the_sources(name: str, value, theirs, source: str) -> str:
    """The line that refuses ``arch.<name>`` = ``value`` where the source ``init_from`` has ``theirs``."""
    return (f"model.init_args.arch.{name}={value}: with init_from the architecture is {source}'s "
            f"({_SOURCE_NAMES[name]}={theirs}); remove the override.")


def source_arch(hf_config: dict) -> dict:
    """The network ``init_from`` builds, as flat ``arch`` keys: the source's shapes and settings under
    ``LlamaConfig``'s names (a head width or key / value head count the family leaves to its defaults as it derives
    them), the query heads of each attention layer MoH gates where they are not ``num_heads`` in every layer
    (``layer_heads``), and their head budget (``head_budget``: a MoH folder's ``moh_*``, else ``default_budget``'s of
    each layer's own heads; one int where every layer has the same). So a run's ``config.yaml`` records the network
    that ran, and a partial ``moh`` override keeps the source's other keys."""
    family = family_config(hf_config)
    arch = {name: getattr(family, theirs) for name, theirs in _SOURCE_FIELDS.items()
            if getattr(family, theirs, None) is not None}
    rope = getattr(family, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(family, "rope_theta", None))
    if theta is not None:
        arch["rope_base"] = float(theta)
    heads = getattr(family, "num_attention_heads", None)
    if heads:
        arch.setdefault("head_dim", family.hidden_size // heads)
        arch.setdefault("num_kv_heads", heads)
    try:
        gated = query_heads(family)
        budget = head_budget(MoHConfig(router="query_norm"), family, gated)
    except ValueError:  # a family MoH cannot gate has no budget to record; a dense run tunes it, a MoH run stops
        return arch
    if list(gated.values()) != [heads] * arch["depth"]:
        arch["layer_heads"] = list(gated.values())
    for key, values in zip(("moh.num_shared_heads", "moh.top_k"), zip(*budget, strict=True), strict=True):
        arch[key] = values[0] if len(set(values)) == 1 else list(values)
    return arch


def warmup_cosine(lr: float, min_lr: float, init_lr: float, warmup_steps: int, total_steps: int):
    """Learning rate at an optimizer step: linear from ``init_lr`` to ``lr``, then cosine down to ``min_lr``."""

    def at(step: int) -> float:
        if step < warmup_steps:
            return init_lr + (lr - init_lr) * step / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))

    return at


__all__ = ["LanguageModel", "check_arch", "not_the_sources", "source_arch", "warmup_cosine"]

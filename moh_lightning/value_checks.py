"""The numbers of a task's or data module's settings, checked where they enter by what their names mean.

A batch size of 0, a negative learning rate or an embedding width of -128 would otherwise train nothing, train the
wrong way or stop deep in torch ("Trying to create tensor with negative dimension"); here they stop in one line naming
the key. The rules go by name, so a new setting of a known kind is checked without a line of its own. The settings
are checked in ``__init__``, not typed as jsonargparse's restricted numbers, because those types would be pickled into
every checkpoint's hyper-parameters.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from moh_lightning.errors import BadValueError

# > 0: rates, sizes and counts that cannot be zero.
POSITIVE = {"lr", "batch_size", "encode_batch_size", "seq_len", "img_size", "image_size", "in_chans", "max_tokens",
            "max_new_tokens", "num_train_timesteps", "sample_steps", "top_k_tokens", "cfg_channels",
            "samples_per_epoch", "val_samples", "latent_scale", "cfg_scale", "beta_start", "beta_end"}
# >= 0
NON_NEGATIVE = {"weight_decay", "warmup_epochs", "warmup_steps", "warmup_lr", "min_lr", "mixup_alpha", "cutmix_alpha",
                "num_workers", "snr_gamma", "temperature", "load_balance_beta", "color_jitter"}
# in [0, 1]
FRACTIONS = {"mixup_prob", "mixup_switch_prob", "label_smoothing", "re_prob", "hflip", "crop_pct", "betas",
             "crop_scale"}
# in (0, 1)
OPEN_FRACTIONS = {"val_fraction"}
# in (0, 1]
TOP_P = {"top_p"}
# A network config's own (``arch``): its numbers named for a drop or a probability are fractions below 1, its other
# floats positive, its ints sizes and counts (>= 1). ``moh`` checks itself (``MoHConfig``).
_ARCH_OWN_CHECKS = {"moh"}


def _numbers(value: Any) -> Iterable[float]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def _rule(name: str) -> tuple[str, Any] | None:
    """(what a value must be, the test) for a setting's name, None when its name says nothing."""
    if name in POSITIVE:
        return "> 0", lambda v: v > 0
    if name in NON_NEGATIVE:
        return ">= 0", lambda v: v >= 0
    if name in FRACTIONS:
        return "between 0 and 1", lambda v: 0 <= v <= 1
    if name in OPEN_FRACTIONS:
        return "between 0 and 1, both excluded", lambda v: 0 < v < 1
    if name in TOP_P:
        return "> 0 and <= 1", lambda v: 0 < v <= 1
    return None


def _arch_rule(name: str, is_float: bool) -> tuple[str, Any]:
    if "drop" in name or "prob" in name:
        return "in [0, 1)", lambda v: 0 <= v < 1
    if is_float:
        return "> 0", lambda v: v > 0
    return "an int >= 1", lambda v: v >= 1


def check_numbers(settings: Mapping[str, Any], prefix: str) -> None:
    """Raises ``BadValueError`` naming ``<prefix>.<key>`` for the first number that cannot work: ``settings`` are a
    task's or data module's ``__init__`` arguments (its ``hparams``); a dataclass among them (``arch``) is checked
    field by field, as each network config checks itself when it is built (from a config's dict too)."""
    for key, value in settings.items():
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            _check(f"{prefix}.{key}", value, _rule(key))
            continue
        for field in dataclasses.fields(value):
            if field.name not in _ARCH_OWN_CHECKS:
                _check(f"{prefix}.{key}.{field.name}", getattr(value, field.name),
                       _arch_rule(field.name, "float" in str(field.type)))


def _check(key: str, value: Any, rule: tuple[str, Any] | None) -> None:
    if rule is None or value is None:
        return
    must, holds = rule
    if not all(holds(number) for number in _numbers(value)):
        raise BadValueError(f"{key}={value}: must be {must}.")

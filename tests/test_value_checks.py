"""The rules by name that check every number of a task's, network config's and data module's settings."""
from __future__ import annotations

import dataclasses

import pytest

from moh_lightning.errors import BadValueError
from moh_lightning.value_checks import FRACTIONS, NON_NEGATIVE, OPEN_FRACTIONS, POSITIVE, TOP_P, check_numbers


@dataclasses.dataclass
class Arch:
    depth: int = 2
    mlp_ratio: float = 4.0
    drop_path_rate: float = 0.1
    moh: dict | None = None  # checks itself


@pytest.mark.parametrize(("names", "refused", "kept"), [
    (POSITIVE, [0, -1, [1, 0]], [1, 1e-9, [1, 2]]),
    (NON_NEGATIVE, [-1, -1e-9], [0, 3]),
    (FRACTIONS, [-0.1, 1.5, [0.9, 1.1]], [0, 1, [0.9, 0.999]]),
    (OPEN_FRACTIONS, [0, 1], [0.5]),
    (TOP_P, [0, 1.5], [1, 0.9]),
])
def test_every_name_of_a_rule_refuses_what_it_rules_out_and_keeps_the_rest(names, refused, kept):
    for name in names:
        for value in refused:
            with pytest.raises(BadValueError, match=rf"^model\.init_args\.{name}={value!s}".replace("[", r"\[")):
                check_numbers({name: value, "unnamed": -5}, "model.init_args")
        for value in kept:
            check_numbers({name: value, "unnamed": -5, "off": None}, "model.init_args")


@pytest.mark.parametrize(("field", "value", "must"), [("depth", 0, "an int >= 1"), ("mlp_ratio", 0.0, "> 0"),
                                                       ("drop_path_rate", 1.0, r"in \[0, 1\)")])
def test_a_network_config_is_checked_field_by_field(field, value, must):
    check_numbers({"arch": Arch(), "lr": 1e-3}, "model.init_args")
    with pytest.raises(BadValueError, match=rf"^model\.init_args\.arch\.{field}={value}: must be {must}\.$"):
        check_numbers({"arch": Arch(**{field: value})}, "model.init_args")
    check_numbers({"arch": Arch(moh={"top_k": -1})}, "model.init_args")  # moh's own checks, not these

"""car_fl.common.choice: settings with a fixed set of values, and the shared checks."""

from __future__ import annotations

import math

import pytest

from car_fl.common.choice import Choice, at_least, one_of, positive


class Colour(Choice):
    RED = "red"
    DARK_BLUE = "dark+blue"


def test_a_choice_is_read_by_its_value_or_its_name_and_a_bad_one_lists_the_values() -> None:
    assert Colour.parse("colour", "dark+blue") is Colour.DARK_BLUE
    assert Colour.parse("colour", Colour.RED) is Colour.RED
    assert Colour["DARK_BLUE"] is Colour["dark+blue"] is Colour.DARK_BLUE  # OmegaConf's lookup
    assert Colour.RED == "red"  # a str: it compares equal to its value
    with pytest.raises(ValueError, match=r"^colour='green' is not valid; choose one of red, dar"):
        Colour.parse("colour", "green")
    with pytest.raises(ValueError):
        Colour["green"]


def test_the_shared_checks_name_the_key_and_refuse_nan() -> None:
    one_of("device", "cpu", ("cpu", "cuda"))
    with pytest.raises(ValueError, match=r"device='tpu' is not valid; choose one of cpu, cuda"):
        one_of("device", "tpu", ("cpu", "cuda"))
    positive("train.lr", 1e-9)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match=r"train\.lr must be > 0"):
            positive("train.lr", bad)
    at_least("head.knn_k", 1, 1)
    for bad in (0, math.nan):
        with pytest.raises(ValueError, match=r"head\.knn_k must be >= 1"):
            at_least("head.knn_k", bad, 1)

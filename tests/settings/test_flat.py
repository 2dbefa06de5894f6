"""car_fl.settings.flat: settings as dotted keys, and the keys two runs differ in."""

from __future__ import annotations

from car_fl.settings.compose import load_settings
from car_fl.settings.flat import changed_keys, flat_settings, flatten


def test_nested_sections_become_dotted_keys() -> None:
    assert flatten({"a": {"b": 1, "c": {"d": None}}, "e": "x"}) == {
        "a.b": 1,
        "a.c.d": None,
        "e": "x",
    }


def test_the_keys_two_runs_differ_in_are_named_with_both_values_and_ignored_ones_left_out() -> None:
    base = load_settings(["model=minilm"])
    other = load_settings(["model=minilm", "train.lr=0.5", "train.epochs=9", "progress=false"])
    assert flat_settings(base)["train.lr"] == base.train.lr
    assert flat_settings(base)["dp.mode"] == "none"  # choices by their value
    assert changed_keys(base, base) == []
    changed = changed_keys(base, other, ignore=("progress", "train.epochs"))
    assert changed == [f"train.lr={base.train.lr}→0.5"]

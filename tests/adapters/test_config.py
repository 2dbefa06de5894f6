"""car_fl.adapters.config: each adapter kind's one registration, and the adapter's section."""

from __future__ import annotations

import pytest

from car_fl.adapters.config import ADAPTERS, AdapterConfig, AdapterKind


def test_every_kind_names_its_class_and_bad_settings_say_what_is_valid() -> None:
    assert list(ADAPTERS) == list(AdapterKind)
    assert all(path.startswith("car_fl.adapters.") for path in ADAPTERS.values())
    assert AdapterConfig(kind="lowrank").kind is AdapterKind.LOWRANK  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"adapter.kind='lora' is not valid; choose one of full"):
        AdapterConfig(kind="lora")  # type: ignore[arg-type]
    for rank in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"adapter\.rank must be an integer >= 1"):
            AdapterConfig(rank=rank)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"adapter\.anchor .* finite number >= 0"):
        AdapterConfig(anchor=float("inf"))

"""car_fl.client.ledger_registry: one ledger per record for every policy of one owner."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from car_fl.client.ledger_registry import REGISTRY_FILE, claim
from car_fl.common.io import state_dir
from car_fl.settings.compose import NodeConfigError


def test_a_second_ledger_over_any_of_the_same_records_is_refused(tmp_path: Path) -> None:
    claim(tmp_path / "a", frozenset({"r1", "r2"}), data="data.tsv")
    claim(tmp_path / "a", frozenset({"r2", "r3"}), data="grown.tsv")  # the same ledger grows
    claim(tmp_path / "b", frozenset({"r4"}), data="other.tsv")  # disjoint records
    with pytest.raises(NodeConfigError, match=r"1 records of copy.tsv .* ledger in .*/a"):
        claim(tmp_path / "c", frozenset({"r3", "r9"}), data="copy.tsv")
    registry = state_dir() / REGISTRY_FILE
    assert stat.S_IMODE(registry.stat().st_mode) == 0o600
    assert stat.S_IMODE(state_dir().stat().st_mode) == 0o700


def test_an_unreadable_registry_refuses_every_claim_and_is_never_reset(tmp_path: Path) -> None:
    registry = state_dir() / REGISTRY_FILE
    registry.write_text("{ not json", encoding="utf-8")
    with pytest.raises(NodeConfigError, match="unreadable"):
        claim(tmp_path / "a", frozenset({"r1"}), data="data.tsv")
    assert registry.read_text(encoding="utf-8") == "{ not json"


def test_the_registry_is_the_owners_not_a_policys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CAR_FL_STATE")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_dir() == tmp_path / "xdg" / "car-fl"

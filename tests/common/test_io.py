"""car_fl.common.io: atomic writes leave the old file whole when the writer fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from car_fl.common.io import atomic_write, atomic_write_json, atomic_write_text


def test_a_write_replaces_the_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "out.json"
    atomic_write_json(target, {"a": 1, "nan": float("nan")})
    assert json.loads(target.read_text().replace("NaN", "null")) == {"a": 1, "nan": None}
    atomic_write_text(target, "second\n")
    assert target.read_text() == "second\n"
    assert [p.name for p in target.parent.iterdir()] == ["out.json"]


def test_a_failing_writer_leaves_the_previous_file_and_no_temporary_file(tmp_path: Path) -> None:
    target = atomic_write_text(tmp_path / "out.txt", "old")

    def fail(tmp: Path) -> None:
        tmp.write_text("half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]

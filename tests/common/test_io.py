"""car_fl.common.io: atomic writes leave the old file whole when the writer fails."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

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


def write_a_byte(tmp: Path) -> None:
    tmp.write_bytes(b"\0")


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_are_readable_as_the_umask_allows(tmp_path: Path, umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        written = [
            atomic_write_text(tmp_path / "a.txt", "x"),
            atomic_write_json(tmp_path / "b.json", {}),
            atomic_write(tmp_path / "c.bin", write_a_byte),
            # safetensors recreates the file 0600 whatever the umask
            atomic_write(tmp_path / "d.st", lambda tmp: save_file({"w": torch.zeros(1)}, str(tmp))),
        ]
    finally:
        os.umask(old)
    assert [stat.S_IMODE(p.stat().st_mode) for p in written] == [mode] * 4


def test_a_secret_is_written_with_exactly_its_mode_whatever_the_umask(tmp_path: Path) -> None:
    seen: list[int] = []

    def write(tmp: Path) -> None:
        seen.append(stat.S_IMODE(tmp.stat().st_mode))  # before a byte is written
        tmp.write_bytes(b"secret")

    old = os.umask(0o000)
    try:
        path = atomic_write(tmp_path / "secret", write, mode=0o600)
    finally:
        os.umask(old)
    assert seen == [0o600] and stat.S_IMODE(path.stat().st_mode) == 0o600

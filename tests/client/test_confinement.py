"""car_fl.client.confinement: what an account other than the owner's could read, and the group."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from car_fl.client.confinement import exposed, group_id, readable, replaceable

#: A group id no file here has: only the "other" bits matter for it.
STRANGER = 2**31 - 7


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every account may enter (pytest's own are the owner's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="cf-open-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_file_is_readable_only_through_folders_the_account_may_enter(open_dir: Path) -> None:
    data = open_dir / "private" / "data.tsv"
    data.parent.mkdir()
    data.write_text("ham\thello\n")
    data.chmod(0o644)
    data.parent.chmod(0o700)  # a home folder of the owner's alone: its 0644 file is safe
    assert not readable(data, STRANGER)
    data.parent.chmod(0o711)  # entered by name: the file's own bits decide
    assert readable(data, STRANGER)
    data.chmod(0o640)  # its group's, not the stranger's
    assert not readable(data, STRANGER)
    own = os.stat(data).st_gid
    assert readable(data, own)
    data.parent.chmod(0o701)  # the kernel reads a member's group bits, not the others'
    assert not readable(data, own) and readable(data.parent, STRANGER)
    data.parent.chmod(0o750)
    data.chmod(0o604)
    assert not readable(data, own) and readable(data, STRANGER) is False  # folder: 0750


def test_a_folder_counts_as_read_when_it_can_be_listed_or_entered(open_dir: Path) -> None:
    cache = open_dir / "cache"
    cache.mkdir(mode=0o700)
    assert not readable(cache, STRANGER)
    cache.chmod(0o701)  # no listing, but a file whose name is known is reachable
    assert readable(cache, STRANGER)


def test_what_is_exposed_is_named_with_its_fix(open_dir: Path) -> None:
    data = open_dir / "data.tsv"
    data.write_text("x\n")
    data.chmod(0o644)
    ledger = open_dir / "ledger"
    ledger.mkdir(mode=0o700)
    found = exposed(
        [("the data file", data), ("the ledger", ledger), ("the cache", open_dir / "none")],
        STRANGER,
    )
    assert len(found) == 1 and found[0].startswith(f"the data file {data} can be read")
    assert f"chmod go-rwx {data}" in found[0]


def test_an_unknown_group_is_named_with_how_to_create_it() -> None:
    with pytest.raises(ValueError, match=r"no such group.*groupadd car-fl-no-such-group"):
        group_id("car-fl-no-such-group")


def test_a_file_another_account_owns_or_may_replace_is_named(open_dir: Path) -> None:
    folder = open_dir / "data"
    folder.mkdir(mode=0o700)
    data = folder / "data.tsv"
    data.write_text("x\n")
    assert replaceable(data, STRANGER) is None  # /tmp's sticky bit keeps others' files theirs
    folder.chmod(0o707)  # others may rename the file and put a link in its place
    assert replaceable(data, STRANGER) == f"the folder {folder} can be written by others"
    folder.chmod(0o1707)  # with the sticky bit they may not
    assert replaceable(data, STRANGER) is None
    if os.geteuid() == 0:
        os.chown(data, 65534, -1)
        assert replaceable(data, STRANGER) == f"{data} belongs to another account (uid 65534)"

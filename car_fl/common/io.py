"""Files processes share: atomic writes (a temporary file in the same folder, fsync'd, then
renamed over the target) and exclusive locks (``fcntl.flock``).

Readers never see a partial file. The file gets mode 0666 less the umask, as ``open()`` would
(not ``mkstemp``'s 0600), whatever the writer does.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def exclusive_lock(path: Path, *, mode: int = 0o666) -> Iterator[None]:
    """Holds an exclusive ``fcntl.flock`` on ``path`` (created with ``mode`` less the umask)
    across processes; the others wait."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def atomic_write(
    path: str | Path, write: Callable[[Path], None], *, mode: int | None = None
) -> Path:
    """Call ``write(tmp_path)`` and rename the result to ``path``; the file is 0666 less the
    umask, or exactly ``mode``, from the moment it is created."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_file(target.parent, prefix=f".{target.name}.", suffix=".tmp", mode=mode)
    mode = tmp.stat().st_mode
    try:
        write(tmp)
        if tmp.stat().st_mode != mode:  # a writer that recreates the file (safetensors: 0600)
            os.chmod(tmp, mode)
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def _new_file(folder: Path, *, prefix: str, suffix: str, mode: int | None = None) -> Path:
    """Create an empty file with a fresh random name in ``folder`` (mode as atomic_write)."""
    create = 0o666 if mode is None else mode
    while True:
        path = folder / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, create)
        except FileExistsError:
            continue
        if mode is not None:
            os.fchmod(fd, mode)  # exactly: the umask only ever removes bits
        os.close(fd)
        return path


def atomic_write_text(path: str | Path, text: str, *, mode: int | None = None) -> Path:
    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")

    return atomic_write(path, write, mode=mode)


def atomic_write_bytes(path: str | Path, data: bytes, *, mode: int | None = None) -> Path:
    def write(tmp: Path) -> None:
        tmp.write_bytes(data)

    return atomic_write(path, write, mode=mode)


def atomic_write_json(path: str | Path, data: Any, *, mode: int | None = None) -> Path:
    return atomic_write_text(
        path, json.dumps(data, indent=2, sort_keys=False, allow_nan=True) + "\n", mode=mode
    )


def state_dir() -> Path:
    """The node owner's or operator's car-fl state folder (created 0700): ``$CAR_FL_STATE``,
    else ``$XDG_STATE_HOME/car-fl``, else ``~/.local/state/car-fl``. State, not cache:
    deleting a cache must lose nothing that matters (a ledger registry, a SuperLink's runs)."""
    base = os.environ.get("CAR_FL_STATE")
    if base:
        folder = Path(base).expanduser()
    else:
        xdg = os.environ.get("XDG_STATE_HOME")
        folder = (Path(xdg) if xdg else Path.home() / ".local" / "state") / "car-fl"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder

"""A node's privacy ledger: every release ever made from one data file, on the node's disk.

Written here because Flower keeps nothing security-relevant on the node across runs: its
``context.state`` is per-run memory, and the server chooses the run. The ledger is keyed by a
content hash of the node's data (:func:`data_key`), not by the run, so every release of every
run, resume and SuperNode restart composes into one ε (:func:`car_fl.privacy.composition.epsilon`,
replace-one, PLD).

- **Recorded before it leaves**: :meth:`Ledger.spend` writes the release before the round
  trains, let alone replies; a crash after it only over-counts, it never loses a spend.
- **No double spending**: the check of the lifetime cap and the write happen under an
  exclusive ``fcntl.flock`` on ``<key>.lock``, so two runs (or two processes) at once cannot
  both spend the same budget.
- **Atomic**: the file is replaced whole (:func:`car_fl.common.io.atomic_write_json`); a reader
  never sees half of it. An unreadable ledger refuses every release (it is never reset).

File: ``<folder>/<key>.json`` = ``{"data_key", "entries": [{run, round, mode, release,
delta, epsilon, time}, ...]}``, where ``epsilon`` is the lifetime ε (at the δ then in force)
right after that release. ``car-fl ledger`` prints it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from car_fl.common.io import atomic_write_json
from car_fl.privacy.composition import Release, epsilon, non_private_count

LEDGER_FORMAT = "car-fl-ledger-v1"
_KEYS: dict[tuple[str, int, int], str] = {}


class LedgerError(RuntimeError):
    """The ledger cannot be read or written: every release is refused until it is fixed."""


class BudgetExhausted(RuntimeError):
    """This release would take the lifetime ε past the policy's cap (nothing was recorded)."""


def data_key(path: str | Path) -> str:
    """sha256 of the data file's bytes: the ledger's key (the same data, the same ledger)."""
    target = Path(path).expanduser().resolve()
    stat = target.stat()
    memo = (str(target), stat.st_size, stat.st_mtime_ns)
    if memo not in _KEYS:
        digest = hashlib.sha256()
        with target.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _KEYS[memo] = digest.hexdigest()
    return _KEYS[memo]


@dataclass(frozen=True)
class Entry:
    """One release (or one round's releases) of the node's data, as the ledger lists it."""

    #: The Flower run it was made in (the server's id: for reading only, never trusted).
    run: str
    round: int
    mode: str
    release: Release
    #: The δ the lifetime ε was computed at, and that ε right after this release.
    delta: float
    epsilon: float
    time: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "round": self.round,
            "mode": self.mode,
            "release": self.release.to_dict(),
            "delta": self.delta,
            "epsilon": self.epsilon,
            "time": self.time,
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Entry:
        return cls(
            run=str(values["run"]),
            round=int(values["round"]),
            mode=str(values["mode"]),
            release=Release.from_dict(values["release"]),
            delta=float(values["delta"]),
            epsilon=float(values["epsilon"]),
            time=str(values["time"]),
        )


class Ledger:
    """The releases of one data file (``key``) in ``folder``; safe across processes."""

    def __init__(self, folder: Path, key: str) -> None:
        self.folder, self.key = folder, key

    @classmethod
    def open(cls, folder: str | Path, key: str) -> Ledger:
        """The ledger of data ``key`` in ``folder`` (created, readable by its owner only)."""
        folder = Path(folder).expanduser()
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        return cls(folder, key)

    @property
    def path(self) -> Path:
        return self.folder / f"{self.key}.json"

    @property
    def lock_path(self) -> Path:
        return self.folder / f"{self.key}.lock"

    @contextmanager
    def locked(self) -> Iterator[None]:
        """An exclusive lock on this ledger, across processes (``fcntl.flock``)."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def entries(self) -> list[Entry]:
        """Every release recorded so far, in order (``LedgerError`` if the file is unreadable)."""
        if not self.path.exists():
            return []
        try:
            content = json.loads(self.path.read_text(encoding="utf-8"))
            if content.get("format") != LEDGER_FORMAT or content.get("data_key") != self.key:
                raise ValueError("not this data's ledger")
            return [Entry.from_dict(e) for e in content["entries"]]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise LedgerError(
                f"privacy ledger {self.path} cannot be read ({err}); no release is made until "
                "it is restored (it is never reset automatically)"
            ) from None

    def epsilon(self, delta: float) -> float:
        """The lifetime ε at δ of every private release recorded."""
        return epsilon([e.release for e in self.entries()], delta)

    def non_private(self) -> int:
        """How many releases carried no noise (their ε is infinite; not in :meth:`epsilon`)."""
        return non_private_count(e.release for e in self.entries())

    def spend(
        self,
        release: Release,
        *,
        run: str,
        server_round: int,
        mode: str,
        delta: float,
        cap: float | None,
        check: Callable[[list[Entry]], None] | None = None,
    ) -> Entry:
        """Record ``release`` unless it would take the lifetime ε past ``cap``; the new entry.

        Under the lock: ``check(entries)`` may refuse first (by raising), then the cap is
        checked and the entry written. Raises :class:`BudgetExhausted` (nothing written).
        """
        with self.locked():
            entries = self.entries()
            if check is not None:
                check(entries)
            after = epsilon([*(e.release for e in entries), release], delta)
            if cap is not None and after > cap:
                raise BudgetExhausted(
                    f"this release would bring the data's lifetime ε to {after:.4g} > "
                    f"lifetime-epsilon {cap:g} (δ = {delta:g}; {len(entries)} entries in "
                    f"{self.path})"
                )
            entry = Entry(
                run=run,
                round=server_round,
                mode=mode,
                release=release,
                delta=delta,
                epsilon=after,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            )
            content = {
                "format": LEDGER_FORMAT,
                "data_key": self.key,
                "entries": [e.to_dict() for e in [*entries, entry]],
            }
            atomic_write_json(self.path, content)
            _sync_folder(self.folder)  # the rename itself survives a power cut
            return entry


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

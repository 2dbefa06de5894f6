"""A node's privacy ledger: every release ever made, accounted per record, on the node's disk.

Each release lists the records it was made from (:func:`record_keys`); a record's lifetime ε
composes every release that listed it, and the cap holds for the most-spent record. A release
is written before the round trains, under an exclusive ``fcntl.flock``, atomically (0600);
an unreadable ledger refuses every release. v1 ledgers (one per data file) are migrated or
refuse. See docs/privacy.md, 'What a node's owner controls'.

File: ``<folder>/ledger.json`` = ``{"format", "records": {set id: [record key, ...]},
"entries": [{run, round, mode, release, records, delta, epsilon, time}, ...]}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import unicodedata
from collections.abc import Callable, Collection, Iterable
from contextlib import AbstractContextManager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from car_fl.client.failures import BudgetExhausted, LedgerError
from car_fl.common.io import atomic_write_json, exclusive_lock
from car_fl.privacy.accountant import Accountant, Release, non_private_count

LEDGER_FORMAT = "car-fl-ledger-v2"
OLD_FORMAT = "car-fl-ledger-v1"
LEDGER_FILE = "ledger.json"
#: Hex digits kept of a record's SHA-256 (128 bits: no two records of a node collide).
RECORD_KEY_HEX = 32


def data_key(path: str | Path) -> str:
    """sha256 of the data file's bytes: the key of a v1 ledger (see :meth:`Ledger.migrate`)."""
    digest = hashlib.sha256()
    with Path(path).expanduser().open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _normalised(text: str) -> str:
    """A record's text as the ledger compares it: Unicode NFC, whitespace runs as one space."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def _key(canonical: str) -> str:
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:RECORD_KEY_HEX]


def record_keys(path: str | Path) -> frozenset[str]:
    """The keys of the records in the node's data file: hashes of their normalised contents. A
    record is a non-empty line (a JSON object's keys sorted) or a Parquet row, whatever the run's
    settings say. Identical records are one record."""
    target = Path(path).expanduser()
    if target.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(target).to_pylist()
        return frozenset(_key(json.dumps(r, sort_keys=True, default=str)) for r in rows)
    keys = set()
    with target.open(encoding="utf-8", errors="surrogateescape") as handle:
        for line in handle:
            text = _normalised(line)
            if not text:
                continue
            if text.startswith("{"):
                with suppress(ValueError):
                    text = json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False)
            keys.add(_key(text))
    return frozenset(keys)


def records_id(records: Collection[str]) -> str:
    """A set of records' id in the ledger file (a digest of its sorted keys)."""
    return hashlib.sha256("\n".join(sorted(records)).encode()).hexdigest()[:RECORD_KEY_HEX]


@dataclass(frozen=True)
class Entry:
    """One release (or one round's releases) of the node's data, as the ledger lists it."""

    #: The Flower run it was made in (the server's id: for reading only, never trusted).
    run: str
    round: int
    mode: str
    release: Release
    #: The id of the set of records it was made from (``records`` of the file).
    records: str
    #: The δ the lifetime ε was computed at, and the ε of its most-spent record after it.
    delta: float
    epsilon: float
    time: str

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "release": self.release.to_dict()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Entry:
        return cls(
            run=str(values["run"]),
            round=int(values["round"]),
            mode=str(values["mode"]),
            release=Release.from_dict(values["release"]),
            records=str(values["records"]),
            delta=float(values["delta"]),
            epsilon=float(values["epsilon"]),
            time=str(values["time"]),
        )


@dataclass(frozen=True)
class Contents:
    """What the ledger file holds: the record sets and the entries."""

    records: dict[str, frozenset[str]]
    entries: list[Entry]

    def releases_of(self, records: Iterable[str]) -> list[list[Release]]:
        """For each distinct way ``records`` were released, the releases (records grouped)."""
        by_signature: dict[frozenset[str], None] = {}
        for record in records:
            signature = frozenset(sid for sid, keys in self.records.items() if record in keys)
            by_signature.setdefault(signature, None)
        return [
            [e.release for e in self.entries if e.records in signature]
            for signature in by_signature
        ]

    def epsilon(
        self, delta: float, records: Iterable[str] | None = None, extra: Release | None = None
    ) -> float:
        """The largest lifetime ε at δ of ``records`` (default: all), ``extra`` released too."""
        chosen = set().union(*self.records.values()) if records is None else set(records)
        groups = self.releases_of(chosen) if chosen else [[]]
        more = [extra] if extra is not None else []
        return max(Accountant([*group, *more]).private_epsilon(delta) for group in groups)

    def unnoised(self, records: Iterable[str]) -> int:
        """The most non-private releases (un-noised rounds) any of ``records`` was part of."""
        return max((non_private_count(g) for g in self.releases_of(set(records))), default=0)


class Ledger:
    """The node's releases in ``folder``, accounted per record; safe across processes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @classmethod
    def open(cls, folder: str | Path) -> Ledger:
        """The ledger in ``folder`` (created, readable by its owner only)."""
        folder = Path(folder).expanduser()
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        return cls(folder)

    @property
    def path(self) -> Path:
        return self.folder / LEDGER_FILE

    @property
    def lock_path(self) -> Path:
        return self.folder / "ledger.lock"

    def locked(self) -> AbstractContextManager[None]:
        """An exclusive lock on this ledger, across processes."""
        return exclusive_lock(self.lock_path, mode=0o600)

    def _old_ledgers(self) -> list[Path]:
        """v1 ledgers (one per data file's bytes) not migrated yet."""
        if not self.folder.is_dir():
            return []
        return sorted(
            p for p in self.folder.glob("*.json") if p.name != LEDGER_FILE and len(p.stem) == 64
        )

    def contents(self) -> Contents:
        """The record sets and every release so far (``LedgerError`` if unreadable)."""
        old = self._old_ledgers()
        if old:
            raise LedgerError(
                f"privacy ledger folder {self.folder} holds a per-file ledger ({OLD_FORMAT}) "
                f"of a data file this node no longer holds unchanged ({old[0].name}): its "
                "releases cannot be tied to records, so no release is made. Put that data "
                "file back (unchanged) and run once to migrate it, or, if you accept losing "
                "that spend, move the file out of the folder"
            )
        if not self.path.exists():
            return Contents({}, [])
        try:
            content = json.loads(self.path.read_text(encoding="utf-8"))
            if content.get("format") != LEDGER_FORMAT:
                raise ValueError(f"format is not {LEDGER_FORMAT}")
            records = {str(k): frozenset(map(str, v)) for k, v in content["records"].items()}
            entries = [Entry.from_dict(e) for e in content["entries"]]
            if any(e.records not in records for e in entries):
                raise ValueError("an entry names a record set the file lacks")
            return Contents(records, entries)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise LedgerError(
                f"privacy ledger {self.path} cannot be read ({err}); no release is made until "
                "it is restored (it is never reset automatically)"
            ) from None

    def entries(self) -> list[Entry]:
        """Every release recorded so far, in order (``LedgerError`` if the file is unreadable)."""
        return self.contents().entries

    def epsilon(self, delta: float, records: Iterable[str] | None = None) -> float:
        """The largest lifetime ε at δ of ``records`` (default: of any record ever released)."""
        return self.contents().epsilon(delta, records)

    def non_private(self) -> int:
        """How many releases carried no noise (their ε is infinite; not in :meth:`epsilon`)."""
        return non_private_count(e.release for e in self.entries())

    def spend(
        self,
        release: Release,
        *,
        records: frozenset[str],
        run: str,
        server_round: int,
        mode: str,
        delta: float,
        cap: float | None,
        unnoised_cap: int | None = None,
        check: Callable[[list[Entry]], None] | None = None,
    ) -> Entry:
        """Record ``release`` of ``records`` unless it would take the lifetime ε of any of them
        past ``cap``, or their un-noised rounds past ``unnoised_cap`` (:class:`BudgetExhausted`);
        under the lock, ``check(entries)`` may refuse first."""
        with self.locked():
            contents = self.contents()
            if check is not None:
                check(contents.entries)
            if not release.private and unnoised_cap is not None:
                unnoised = contents.unnoised(records) + release.count
                if unnoised > unnoised_cap:
                    raise BudgetExhausted(
                        f"this release would be a record's un-noised round number {unnoised} > "
                        f"lifetime-unnoised-rounds {unnoised_cap} ({self.path})"
                    )
            after = contents.epsilon(delta, records, extra=release)
            if cap is not None and after > cap:
                raise BudgetExhausted(
                    f"this release would bring a record's lifetime ε to {after:.4g} > "
                    f"lifetime-epsilon {cap:g} (δ = {delta:g}; {len(contents.entries)} "
                    f"entries in {self.path})"
                )
            entry = Entry(
                run=run,
                round=server_round,
                mode=mode,
                release=release,
                records=records_id(records),
                delta=delta,
                epsilon=after,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            )
            sets = {**contents.records, entry.records: records}
            self._write(sets, [*contents.entries, entry])
            return entry

    def migrate(self, key: str, records: frozenset[str]) -> int:
        """Import the v1 ledger of the data file whose sha256 is ``key`` (the node's data file,
        unchanged since), its releases tied to ``records``; how many entries were imported."""
        old = self.folder / f"{key}.json"
        if not old.is_file():
            return 0
        with self.locked():
            if not old.is_file():
                return 0
            try:
                content = json.loads(old.read_text(encoding="utf-8"))
                if content.get("format") != OLD_FORMAT or content.get("data_key") != key:
                    raise ValueError(f"not a {OLD_FORMAT} ledger of this data")
                imported = [
                    Entry.from_dict({**e, "records": records_id(records)})
                    for e in content["entries"]
                ]
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise LedgerError(
                    f"old privacy ledger {old} cannot be read ({err}); no release is made "
                    "until it is restored"
                ) from None
            old.rename(old.with_name(old.name + ".migrated"))  # before: so contents() reads
            try:
                contents = self.contents()
            except LedgerError:
                old.with_name(old.name + ".migrated").rename(old)
                raise
            sets = {**contents.records, records_id(records): records}
            self._write(sets, [*imported, *contents.entries])
            return len(imported)

    def _write(self, sets: dict[str, frozenset[str]], entries: list[Entry]) -> None:
        content = {
            "format": LEDGER_FORMAT,
            "records": {sid: sorted(keys) for sid, keys in sets.items()},
            "entries": [e.to_dict() for e in entries],
        }
        atomic_write_json(self.path, content, mode=0o600)
        _sync_folder(self.folder)  # the rename itself survives a power cut


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

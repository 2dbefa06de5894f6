"""Which ledger covers which records, for every policy of one node owner: one ledger per data.

Written here because a ledger's folder comes from the policy file (``ledger = ...``): two
policy files naming the same data file (or a copy of it) kept two ledgers, each with the whole
lifetime budget (issue 41: a per-record ε of 46.2 against a cap of 30). The registry is the
owner's, not a policy's: ``$CAR_FL_STATE``, else ``$XDG_STATE_HOME/car-fl``, else
``~/.local/state/car-fl`` (state, not cache: deleting a cache must not reset a budget), file
``ledgers.json`` (0600, folder 0700), changed under an exclusive ``fcntl.flock``.

:func:`claim` is called when a node opens its policy: the ledger folder the policy names takes
the data's records, unless another ledger already covers any of them; then the policy is
refused, naming that ledger, so that every record has one ledger whatever policy file names it.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from car_fl.common.io import atomic_write_json, state_dir
from car_fl.settings.flower import NodeConfigError

REGISTRY_FORMAT = "car-fl-ledger-registry-v1"
REGISTRY_FILE = "ledgers.json"


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with (folder / "ledgers.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(path: Path) -> dict[str, list[str]]:
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
        if content.get("format") != REGISTRY_FORMAT:
            raise ValueError(f"not a {REGISTRY_FORMAT} file")
        return {str(k): [str(r) for r in v] for k, v in content["ledgers"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise NodeConfigError(
            f"the ledger registry {path} is unreadable ({err}); every release is refused "
            "until it is repaired (it is never reset)"
        ) from err


def claim(ledger: Path, records: frozenset[str], *, data: str | Path) -> None:
    """Register ``records`` (of the data file ``data``) as covered by the ledger in
    ``ledger``; a ``NodeConfigError`` naming the other ledger when one already covers any
    of them."""
    folder = state_dir()
    path = folder / REGISTRY_FILE
    mine = str(Path(ledger).expanduser().resolve())
    with _locked(folder):
        ledgers = _read(path)
        for other, covered in ledgers.items():
            if other == mine:
                continue
            shared = records.intersection(covered)
            if shared:
                raise NodeConfigError(
                    f"{len(shared)} records of {data} are already covered by the ledger in "
                    f"{other}; one record has one ledger, whatever policy names it: set "
                    f"ledger = {other!r} in this policy"
                )
        ledgers[mine] = sorted(set(ledgers.get(mine, ())) | records)
        atomic_write_json(path, {"format": REGISTRY_FORMAT, "ledgers": ledgers}, mode=0o600)

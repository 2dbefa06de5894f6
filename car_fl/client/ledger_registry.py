"""Which ledger covers which records, for every policy of one node owner: one ledger per data.

Two policies naming the same data must not keep two ledgers, each with the whole budget. The
owner's registry (``$CAR_FL_STATE``, else ``$XDG_STATE_HOME/car-fl``, else
``~/.local/state/car-fl``; state, not cache) is ``ledgers.json`` (0600, under ``fcntl.flock``).
"""

from __future__ import annotations

import json
from pathlib import Path

from car_fl.common.io import atomic_write_json, exclusive_lock, state_dir
from car_fl.settings.compose import NodeConfigError

REGISTRY_FORMAT = "car-fl-ledger-registry-v1"
REGISTRY_FILE = "ledgers.json"


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
    with exclusive_lock(folder / "ledgers.lock"):
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

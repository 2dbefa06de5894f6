"""Every run's state on a node (its DP state), in one store the node's :class:`Node` owns.

A round works on a copy (:meth:`RunStates.get`), kept only once it succeeded
(:meth:`RunStates.keep`). A worker keeps them in memory and in ``runs/<run id>.state`` (0600,
atomic); without one they live in Flower's ``context.state`` (:class:`ContextState`). Across
runs, only the ledger caps a record's spend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from flwr.app import RecordDict

from car_fl.common.io import atomic_write
from car_fl.protocol.wire import decode_content, encode_content

#: The folder of the run states, under a worker's folder.
RUNS_DIR = "runs"


#: Flower's run ids are unsigned 64-bit integers.
MAX_RUN_ID = 2**64 - 1


def run_key(run: str | int) -> str:
    """A run id as its one spelling (an unsigned 64-bit integer in ASCII digits: "07" is run 7);
    ``ValueError`` for anything else (a sign, "7_0", "٧", a path)."""
    text = str(run) if not isinstance(run, bool) else ""
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_RUN_ID:
        raise ValueError(f"run id {run!r} is not an unsigned 64-bit integer in ASCII digits")
    return str(int(text))


def copy_of(state: RecordDict) -> RecordDict:
    """An independent copy of a run's state (through its serialised form)."""
    return decode_content(encode_content(state))


class RunStore(Protocol):
    """Where a node keeps its runs' states: :meth:`get` a copy, :meth:`keep` after success."""

    def get(self, run: str) -> RecordDict: ...

    def keep(self, run: str, state: RecordDict) -> None: ...


class ContextState:
    """Each run's state in Flower's ``context.state``, under ``run-<id>/``: Flower keeps it per
    run series, and a new run must not inherit the last one's accountant."""

    def __init__(self, state: RecordDict) -> None:
        self.state = state

    @staticmethod
    def prefix(run: str) -> str:
        return f"run-{run_key(run)}/"

    def get(self, run: str) -> RecordDict:
        """A copy of the run's state (empty for a run never seen)."""
        prefix = self.prefix(run)
        mine = RecordDict(
            {k[len(prefix) :]: v for k, v in self.state.items() if k.startswith(prefix)}
        )
        return copy_of(mine)

    def keep(self, run: str, state: RecordDict) -> None:
        """Write the run's ``state`` back into ``context.state`` (a round that succeeded);
        other runs' records stay as they were."""
        prefix = self.prefix(run)
        for key in [k for k in self.state if k.startswith(prefix)]:
            del self.state[key]
        for key, record in copy_of(state).items():
            self.state[prefix + key] = record


class RunStates:
    """Each run's state by run id: in memory, and in ``folder`` when there is one."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self._states: dict[str, RecordDict] = {}

    def runs(self) -> list[str]:
        return sorted(self._states, key=lambda run: (len(run), run))

    def _file(self, run: str) -> Path | None:
        return self.folder / f"{run}.state" if self.folder is not None else None

    def get(self, run: str) -> RecordDict:
        """A copy of the run's state (empty for a run never seen)."""
        run = run_key(run)
        if run not in self._states:
            path = self._file(run)
            self._states[run] = (
                decode_content(path.read_bytes())
                if path is not None and path.is_file()
                else RecordDict()
            )
        return copy_of(self._states[run])

    def keep(self, run: str, state: RecordDict) -> None:
        """The run's state after a round that succeeded."""
        run = run_key(run)
        path = self._file(run)
        if path is not None:
            data = encode_content(state)

            def write(tmp: Path) -> None:
                tmp.write_bytes(data)

            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(path, write, mode=0o600)  # the run's DP state
        self._states[run] = state

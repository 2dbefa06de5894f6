"""A run's results as typed rows that write and read themselves: metrics.json/.csv, clients.csv.

Centralised runs (a "round" is an epoch) and federations write the same format. The wire
carries kebab-case metric keys, the files snake_case: :func:`wire_key` maps between them.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from car_fl.common.io import atomic_write_json, atomic_write_text

METRICS_JSON = "metrics.json"
METRICS_CSV = "metrics.csv"
PLOT_PNG = "curves.png"
CLIENTS_CSV = "clients.csv"
#: Prefixes of the evaluation columns: validation (selects the model) and test (reported).
EVAL_PREFIXES = ("val_", "test_")


def wire_key(column: str) -> str:
    """The wire's metric key of a file column: ``dp_noise_multiplier`` → ``dp-noise-multiplier``."""
    return column.replace("_", "-")


@dataclass(kw_only=True)
class RoundRow:
    """One round of a federation, or one epoch of a centralised run (a row of ``metrics.csv``);
    columns that are ``None`` are not written."""

    round: int
    epochs: int
    train_loss: float | None = None
    train_accuracy: float | None = None
    #: ``val_*`` and ``test_*`` metrics of the model after this round.
    metrics: dict[str, float]
    seconds: float
    bytes_sent: int = 0
    bytes_received: int = 0
    # A federation's columns
    bytes_sent_per_client: int | None = None
    clients_asked: int | None = None
    clients_ok: int | None = None
    clients_rejected: int | None = None
    clients_failed: int | None = None
    skipped: int | None = None
    dp_active: int | None = None
    #: The largest ε any client has spent so far (δ = dp.delta), by the server's own figures.
    epsilon: float | None = None
    #: Clients whose own ε claim this round differed from the server's figure.
    claims_flagged: int | None = None
    max_client_train_seconds: float | None = None
    #: Columns this version does not know (kept so that reading and writing loses nothing).
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The row as written, in column order."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("metrics", "extra"):
                out.update(value)
            elif value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> RoundRow:
        names = {f.name for f in fields(cls)} - {"metrics", "extra"}
        metrics = {k: v for k, v in row.items() if k.startswith(EVAL_PREFIXES)}
        return cls(
            **{k: v for k, v in row.items() if k in names},
            metrics=metrics,
            extra={k: v for k, v in row.items() if k not in names and k not in metrics},
        )


@dataclass
class ClientRow:
    """One client in one round (a row of ``clients.csv``); under DP the train cells are empty."""

    round: int
    node: int
    status: str  # ok, rejected, failed
    reason: str = ""
    partition_id: float | None = None
    num_examples: float | None = None
    train_loss: float | None = None
    train_accuracy: float | None = None
    train_seconds: float | None = None
    encoder_loads: float | None = None
    torch_threads: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    update_norm: float | None = None
    dp_active: float | None = None
    dp_epsilon: float | None = None
    dp_releases: float | None = None
    dp_noise_multiplier: float | None = None
    dp_sample_rate: float | None = None
    dp_steps: float | None = None
    #: The server's ε of this node so far (the report's figure; ``dp_epsilon`` is the claim).
    server_epsilon: float | None = None
    #: Why the node's claim (``dp_epsilon``, ``dp_active``) differs from the server's; "" if not.
    claim_mismatch: str = ""

    #: Counts and ids: written as integers (the wire may carry them as floats, 2.0).
    INTEGER_COLUMNS: ClassVar[tuple[str, ...]] = (
        "partition_id",
        "num_examples",
        "encoder_loads",
        "torch_threads",
        "dp_active",
        "dp_releases",
        "dp_steps",
    )
    #: The columns that are the client's own metrics, sent under :func:`wire_key` names.
    FROM_WIRE: ClassVar[tuple[str, ...]] = (
        "partition_id",
        "num_examples",
        "train_loss",
        "train_accuracy",
        "train_seconds",
        "encoder_loads",
        "torch_threads",
        "dp_active",
        "dp_epsilon",
        "dp_releases",
        "dp_noise_multiplier",
        "dp_sample_rate",
        "dp_steps",
    )

    def __post_init__(self) -> None:
        # An integral count is an int (``partition_id`` 0, not 0.0); a value that is not
        # integral stays what the client sent, so that clients.csv shows it.
        for name in self.INTEGER_COLUMNS:
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                setattr(self, name, int(value))

    @classmethod
    def from_csv(cls, row: Mapping[str, str]) -> ClientRow:
        """A row as :func:`csv.DictReader` gives it: strings, empty for ``None``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = row.get(f.name, "")
            if f.type == "int":
                values[f.name] = int(raw)
            elif f.type == "str":
                values[f.name] = raw
            else:
                values[f.name] = float(raw) if raw != "" else None
        return cls(**values)

    @staticmethod
    def write_csv(path: str | Path, rows: Iterable[ClientRow]) -> None:
        write_csv(path, [asdict(row) for row in rows])

    @classmethod
    def read_csv(cls, path: str | Path) -> list[ClientRow]:
        with Path(path).open(encoding="utf-8", newline="") as handle:
            return [cls.from_csv(row) for row in csv.DictReader(handle)]


@dataclass
class ClientDP:
    """A client's record-level DP (``dp=record``): σ, sampling rate, steps and ε so far, by the
    server's own figures; :meth:`from_wire` reads a client's claim of them."""

    noise_multiplier: float
    sample_rate: float
    steps: float
    epsilon: float

    @classmethod
    def from_wire(cls, metrics: Mapping[str, float]) -> ClientDP | None:
        """From a reply's metrics; ``None`` unless it carries all four record-level DP values."""
        keys = {f.name: wire_key(f"dp_{f.name}") for f in fields(cls)}
        if any(key not in metrics for key in keys.values()):
            return None
        return cls(**{name: metrics[key] for name, key in keys.items()})


@dataclass(kw_only=True)
class RunSummary:
    """``metrics.json``'s summary of a run; fields that are ``None`` are not written."""

    kind: str  # centralized, federated
    clients: int
    mode: str
    head: str
    epochs: int | None = None
    num_labels: int
    rounds: int | None = None
    local_epochs: int | None = None
    #: ``val_*``/``test_*`` of the initial global model (a federation's round 0).
    initial: dict[str, float] | None = None
    final: RoundRow | None
    best: RoundRow | None
    feature_seconds: float | None = None
    total_seconds: float
    train_examples: int | None = None
    test_examples: int
    selection: str
    #: Split sizes and the duplicates removed before splitting.
    data: dict[str, int]
    skipped_rounds: list[int] | None = None
    #: The round (or epoch) after which ``train.patience`` ended the run (None: it ran all).
    stopped_early: int | None = None
    dp: str | None = None
    delta: float | None = None
    epsilon: float | None = None
    #: Nodes whose ε claim differed from the server's figure in some round (sorted node ids).
    flagged_clients: list[int] | None = None
    #: Record-level DP per partition id; written only when some client ran it.
    dp_clients: dict[int, ClientDP] = field(default_factory=dict)
    #: Whether the run ended (a federation rewrites its files after every round).
    complete: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("final", "best"):
                out[f.name] = value.to_dict() if value is not None else None
            elif f.name == "dp_clients":
                if value:
                    out[f.name] = {pid: asdict(dp) for pid, dp in value.items()}
            elif f.name == "extra":
                out.update(value)
            elif value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, summary: Mapping[str, Any]) -> RunSummary:
        names = {f.name for f in fields(cls)} - {"extra"}
        values = {k: v for k, v in summary.items() if k in names}
        for key in ("final", "best"):
            row = values.get(key)
            values[key] = RoundRow.from_dict(row) if row is not None else None
        values["dp_clients"] = {
            int(pid): ClientDP(**dp) for pid, dp in values.get("dp_clients", {}).items()
        }
        extra = {k: v for k, v in summary.items() if k not in names}
        return cls(**values, extra=extra)


@dataclass
class MetricsFile:
    """``metrics.json`` (kind, history, summary) and ``metrics.csv`` (the history)."""

    history: list[RoundRow]
    summary: RunSummary

    def write(self, folder: str | Path) -> None:
        folder = Path(folder)
        rows = [row.to_dict() for row in self.history]
        content = {"kind": self.summary.kind, "history": rows, "summary": self.summary.to_dict()}
        atomic_write_json(folder / METRICS_JSON, content)
        write_csv(folder / METRICS_CSV, rows)

    @classmethod
    def read(cls, folder: str | Path) -> MetricsFile:
        """Read ``folder/metrics.json``; ``ValueError`` if it is not a car-fl metrics file."""
        path = Path(folder) / METRICS_JSON
        content = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(content, dict) or "history" not in content or "summary" not in content:
            raise ValueError(f"{path} is not a car-fl metrics file (no history and summary)")
        return cls(
            history=[RoundRow.from_dict(row) for row in content["history"]],
            summary=RunSummary.from_dict(content["summary"]),
        )


def write_csv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Rows of dicts as CSV; the columns are the union of keys in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buffer.getvalue())

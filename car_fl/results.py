"""Results people can read: per-round (or per-epoch) metrics as JSON and CSV, and PNG plots.

Centralised runs and federations write the same format: one row per round, where a
centralised "round" is one epoch, so "FL vs centralised" is one comparison of two files.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path
from typing import Any

from car_fl.io import atomic_write, atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

METRICS_JSON = "metrics.json"
METRICS_CSV = "metrics.csv"
PLOT_PNG = "curves.png"
CLIENTS_CSV = "clients.csv"


def write_metrics(
    folder: str | Path, *, kind: str, history: list[dict[str, Any]], summary: dict[str, Any]
) -> None:
    """``metrics.json`` (kind, history, summary) and ``metrics.csv`` (the history)."""
    folder = Path(folder)
    atomic_write_json(folder / METRICS_JSON, {"kind": kind, "history": history, "summary": summary})
    write_csv(folder / METRICS_CSV, history)


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


def plot_curves(
    folder: str | Path, history: list[dict[str, Any]], *, title: str, x_label: str = "round"
) -> Path | None:
    """Loss and accuracy per round: train and test loss, test top-1 and top-K accuracy."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [row["round"] for row in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (
        ("train_loss", "train loss"),
        ("val_loss", "validation loss"),
        ("test_loss", "test loss"),
    ):
        values = [row.get(key) for row in history]
        if any(v is not None for v in values):
            ax_loss.plot(x, values, marker="o", label=label)
    acc_keys = [k for k in ("val_top1",) if k in history[-1]]
    acc_keys += [k for k in history[-1] if k.startswith("test_top")]
    for key in acc_keys + (["train_accuracy"] if "train_accuracy" in history[-1] else []):
        ax_acc.plot(x, [row.get(key) for row in history], marker="o", label=key)
    ax_loss.set(xlabel=x_label, ylabel="cross-entropy", title=f"{title}: loss")
    ax_acc.set(xlabel=x_label, ylabel="accuracy", title=f"{title}: accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(folder) / PLOT_PNG
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return path

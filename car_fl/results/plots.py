"""PNG plots: one run's curves (``curves.png``) and the report's comparison of runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from car_fl.common.io import atomic_write
from car_fl.results.rows import PLOT_PNG, RoundRow
from car_fl.settings.schema import DatasetConfig, ModelConfig


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    _pyplot().close(fig)
    return path


def data_label(dataset: DatasetConfig) -> str:
    """What a plot calls the data a run used: the local file's name, else the Hub dataset."""
    return dataset.label


def model_label(model: ModelConfig) -> str:
    """What a plot calls the frozen encoder: its preset, or a local folder's name."""
    if model.name == "local":
        return Path(model.name_or_path).name or model.name_or_path
    return model.name


#: One colour per split, the same in the loss and the accuracy panel (loss and top-1).
SPLIT_COLOURS = {"train": "tab:blue", "val": "tab:orange", "test": "tab:green"}
#: Test top-K (K > 1): colours no split uses, so that no two lines of a panel share one.
TOP_K_COLOURS = ("tab:red", "tab:purple", "tab:brown", "tab:pink")
SPLIT_WORDS = {"train": "train", "val": "validation", "test": "test"}


def legend_label(key: str) -> str:
    """A metric key in words: ``val_top1`` → "validation top-1", ``train_loss`` → "train
    loss", ``train_accuracy`` → "train accuracy"."""
    split, metric = key.split("_", 1)
    if metric.startswith("top") and metric[3:].isdigit():
        metric = f"top-{metric[3:]}"
    return f"{SPLIT_WORDS[split]} {metric}"


def split_colour(key: str) -> str:
    """The colour of the split a metric key belongs to (``train_loss``, ``val_top1``, ...)."""
    return SPLIT_COLOURS[key.split("_", 1)[0]]


def shown_top_k(key: str, num_labels: int | None) -> bool:
    """Whether a ``test_topK`` curve says anything: K = 1, or K below the number of labels
    (top-K of K or more labels is 1.0 by definition)."""
    k = int(key.removeprefix("test_top"))
    return k == 1 or num_labels is None or k < num_labels


def plot_curves(
    folder: str | Path,
    history: Sequence[RoundRow],
    *,
    title: str,
    x_label: str = "round",
    num_labels: int | None = None,
    selected: int | None = None,
) -> Path | None:
    """``curves.png`` in ``folder`` (:func:`curves_figure`); ``None`` without rows."""
    if not history:
        return None
    fig = curves_figure(
        history, title=title, x_label=x_label, num_labels=num_labels, selected=selected
    )
    return _save(fig, Path(folder) / PLOT_PNG)


def curves_figure(
    history: Sequence[RoundRow],
    *,
    title: str,
    x_label: str,
    num_labels: int | None,
    selected: int | None = None,
) -> Any:
    """Loss and accuracy per round, per split, with the round ``selected`` on validation marked
    (a split keeps its colour across panels; top-K only for K below ``num_labels``)."""
    from matplotlib.ticker import MaxNLocator

    rows = [row.to_dict() for row in history]
    x = [row["round"] for row in rows]
    fig, (ax_loss, ax_acc) = _pyplot().subplots(1, 2, figsize=(10, 4))
    for key in ("train_loss", "val_loss", "test_loss"):
        values = [row.get(key) for row in rows]
        if any(v is not None for v in values):
            colour = split_colour(key)
            ax_loss.plot(x, values, marker="o", label=legend_label(key), color=colour)
    acc_keys = [k for k in ("val_top1",) if k in rows[-1]]
    acc_keys += [
        k
        for k in rows[-1]
        if k.startswith("test_top") and k[8:].isdigit() and shown_top_k(k, num_labels)
    ]
    acc_keys += ["train_accuracy"] if "train_accuracy" in rows[-1] else []
    top_ks = [k for k in acc_keys if k.startswith("test_top") and k != "test_top1"]
    for key in acc_keys:
        colour = (
            TOP_K_COLOURS[top_ks.index(key) % len(TOP_K_COLOURS)]
            if key in top_ks
            else split_colour(key)
        )
        values = [row.get(key) for row in rows]
        ax_acc.plot(x, values, marker="o", label=legend_label(key), color=colour)
    ax_loss.set(xlabel=x_label, ylabel="cross-entropy", title=f"{title}: loss")
    ax_acc.set(xlabel=x_label, ylabel="accuracy", title=f"{title}: accuracy")
    for ax in (ax_loss, ax_acc):
        if selected is not None:
            ax.axvline(
                selected,
                color="grey",
                linestyle=":",
                label=f"selected on validation ({x_label} {selected})"
                if selected
                else "selected on validation: the starting point",
            )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def wide_range(ax: Any, ratio: float = 100.0) -> bool:
    """Whether the positive values an axis draws span more than ``ratio`` (then a log scale
    keeps the small ones readable beside the large)."""
    values = [
        float(y)
        for line in ax.get_lines()
        for y in line.get_ydata()
        if math.isfinite(float(y)) and float(y) > 0
    ]
    return bool(values) and max(values) / min(values) > ratio


def plot_against_epochs(path: Path, lines: dict[str, list[RoundRow]], *, title: str) -> None:
    """Test loss and top-1 against epochs (FL: round × local epochs), one line per label; a
    run that trained nothing is a flat reference line."""
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_acc) = _pyplot().subplots(1, 2, figsize=(11, 4))
    span = max((h.epochs for hist in lines.values() for h in hist), default=0) or 1
    for label, history in lines.items():
        x = [h.epochs for h in history]
        if len(history) == 1 and not x[0]:  # trains nothing: a flat reference line
            # (kNN's vote counts are no logits: its cross-entropy means nothing)
            axes = [(ax_acc, "test_top1")] + (
                [] if label.startswith("kNN") else [(ax_loss, "test_loss")]
            )
            for ax, key in axes:
                ax.plot([0, span], [history[0].metrics[key]] * 2, linestyle="--", label=label)
            continue
        loss = [h.metrics["test_loss"] for h in history]
        top1 = [h.metrics["test_top1"] for h in history]
        ax_loss.plot(x, loss, marker="o", markersize=3, label=label)
        ax_acc.plot(x, top1, marker="o", markersize=3, label=label)
    ax_loss.set(xlabel="epochs (FL: round × local epochs)", ylabel="test loss", title=title)
    if wide_range(ax_loss):  # e.g. MIPS's loss near 32 beside CaR's near 0: log, or unreadable
        ax_loss.set_yscale("log")
        ax_loss.set_ylabel("test loss (log scale)")
    ax_acc.set(xlabel="epochs (FL: round × local epochs)", ylabel="test top-1 accuracy")
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)

"""car_fl.results.plots: what a run's curves.png shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from car_fl.results.plots import curves_figure, data_label, plot_curves
from car_fl.results.rows import RoundRow
from car_fl.settings.schema import DatasetConfig


def rows(rounds: int) -> list[RoundRow]:
    metrics = {"val_top1": 0.5, "test_loss": 1.0}
    metrics |= {f"test_top{k}": 0.5 for k in (1, 3, 5, 10)}
    return [
        RoundRow(round=r, epochs=2 * r, train_loss=1.0, metrics=metrics, seconds=1.0)
        for r in range(1, rounds + 1)
    ]


def test_top_k_lines_only_below_the_number_of_labels_and_integer_rounds() -> None:
    fig = curves_figure(rows(3), title="t", x_label="round", num_labels=4)
    _, acc = fig.axes
    labels = [line.get_label() for line in acc.get_lines()]
    assert labels == ["val_top1", "test_top1", "test_top3"]  # top-5/10 of 4 labels: always 1
    two_labels = curves_figure(rows(3), title="t", x_label="round", num_labels=2)
    assert [line.get_label() for line in two_labels.axes[1].get_lines()] == [
        "val_top1",
        "test_top1",
    ]
    for ax in fig.axes:  # rounds 1, 2, 3: no 1.5 or 2.5 on the axis
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)


def test_titles_name_the_data_actually_used(tmp_path: Path) -> None:
    assert data_label(DatasetConfig(path="/tmp/x/synthetic.tsv")) == "synthetic.tsv"
    assert data_label(DatasetConfig()) == "ucirvine/sms_spam"
    assert plot_curves(tmp_path, rows(2), title="t", num_labels=4) == tmp_path / "curves.png"
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert plot_curves(tmp_path / "none", [], title="t") is None


def test_a_split_has_one_colour_in_both_panels() -> None:
    history = [
        RoundRow(
            round=r,
            epochs=r,
            train_loss=1.0,
            train_accuracy=0.5,
            metrics={"val_loss": 1.0, "val_top1": 0.5, "test_loss": 1.0, "test_top1": 0.5}
            | {"test_top3": 0.7},
            seconds=1.0,
        )
        for r in (1, 2)
    ]
    loss, acc = curves_figure(history, title="t", x_label="round", num_labels=5).axes
    colours = {line.get_label(): line.get_color() for ax in (loss, acc) for line in ax.get_lines()}
    assert colours["train loss"] == colours["train_accuracy"]
    assert colours["validation loss"] == colours["val_top1"]
    assert colours["test loss"] == colours["test_top1"] == colours["test_top3"]
    assert len({colours["train loss"], colours["validation loss"], colours["test loss"]}) == 3


def test_the_sweep_plot_ticks_whole_epochs_and_names_the_data_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt

    from car_fl.results.plots import plot_against_epochs

    seen = []
    original = plt.Figure.savefig

    def keep(fig: Any, *args: Any, **kwargs: Any) -> Any:  # the figure as saved
        seen.append(fig)
        return original(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    plot_against_epochs(tmp_path / "p.png", {"a": rows(2)}, title="t")
    for ax in seen[0].axes:  # epochs 2 and 4: no 2.5 on the axis
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
    assert DatasetConfig(path="/tmp/x/synthetic.tsv").label == "synthetic.tsv"  # not sms_spam

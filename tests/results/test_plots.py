"""car_fl.results.plots: what a run's curves.png shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from car_fl.results.plots import curves_figure, data_label, model_label, plot_curves
from car_fl.results.rows import RoundRow
from car_fl.settings.schema import DatasetConfig, ModelConfig


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
    assert labels == ["validation top-1", "test top-1", "test top-3"]  # top-5/10 of 4: always 1
    two_labels = curves_figure(rows(3), title="t", x_label="round", num_labels=2)
    assert [line.get_label() for line in two_labels.axes[1].get_lines()] == [
        "validation top-1",
        "test top-1",
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


def test_legends_in_words_one_colour_a_line_and_the_selected_round_marked() -> None:
    history = [
        RoundRow(
            round=r,
            epochs=r,
            train_loss=1.0,
            train_accuracy=0.5,
            metrics={"val_loss": 1.0, "val_top1": 0.5, "test_loss": 1.0, "test_top1": 0.5}
            | {"test_top3": 0.7, "test_top5": 0.9},
            seconds=1.0,
        )
        for r in (1, 2, 3)
    ]
    loss, acc = curves_figure(history, title="t", x_label="epoch", num_labels=10, selected=2).axes
    for ax in (loss, acc):  # no key names beside words; every line its own colour
        labels = [line.get_label() for line in ax.get_lines()]
        assert not any("_" in label for label in labels), labels
        assert len({line.get_color() for line in ax.get_lines()}) == len(labels)
        marked = [line for line in ax.get_lines() if line.get_label().startswith("selected")]
        assert [m.get_label() for m in marked] == ["selected on validation (epoch 2)"]
        assert list(marked[0].get_xdata()) == [2, 2]
    colours = {line.get_label(): line.get_color() for ax in (loss, acc) for line in ax.get_lines()}
    assert colours["train loss"] == colours["train accuracy"]  # a split keeps its colour
    assert colours["validation loss"] == colours["validation top-1"]
    assert colours["test loss"] == colours["test top-1"] != colours["test top-3"]
    assert len({colours["train loss"], colours["validation loss"], colours["test loss"]}) == 3
    unmarked = curves_figure(history, title="t", x_label="epoch", num_labels=10).axes[1]
    assert not any(line.get_label().startswith("selected") for line in unmarked.get_lines())


def test_a_plot_names_the_model(tmp_path: Path) -> None:
    assert model_label(ModelConfig(name="smollm2", name_or_path="gguf:smollm2")) == "smollm2"
    assert model_label(ModelConfig(name="local", name_or_path="/tmp/car-fl-tiny/llama")) == "llama"


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

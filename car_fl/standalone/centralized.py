"""Centralised training: the whole training split on one machine, one row of metrics per epoch.

What ``car-fl train`` runs, the federation's reference; the epochs drive a
:class:`~car_fl.results.run.Run` (also a run that trains nothing: MIPS, kNN).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from car_fl.data.splits import DataSplits, load_splits
from car_fl.model.features import LocalData, prepare_for
from car_fl.model.retriever import CaRRetriever, build_retriever
from car_fl.model.sources import check_sources
from car_fl.results.plots import data_label, model_label
from car_fl.results.rows import RoundRow, RunSummary
from car_fl.results.run import (
    CENTRALIZED,
    ResumePoint,
    Run,
    load_optimizer_tensors,
    open_run_dir,
)
from car_fl.serving.checkpoint import checkpoint_extra
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.schema import Mode, Settings, nothing_to_train
from car_fl.training.train import HeldOut, LazyRetriever, make_optimizer, one_epoch, probe_head

log = logging.getLogger(__name__)


def run_centralized(settings: Settings, output_dir: str | Path | None = None) -> dict[str, Any]:
    """Train for ``train.epochs`` epochs, evaluating after each; returns the summary. DP is
    refused (:func:`check_no_dp`); ``settings.resume`` goes on after a run's last epoch."""
    check_no_dp(settings)
    if settings.resume and nothing_to_train(settings):
        raise ValueError(
            f"resume={settings.resume}: this run trains nothing (MIPS or kNN on the frozen "
            "encoder), so there is nothing to continue; run it again without resume="
        )
    out, point = open_run_dir(settings, CENTRALIZED, output_dir)
    check_sources(settings)  # seconds, not a minute of Hub retries, when offline
    prepared = prepare(settings, probe=point is None)
    if point is not None:
        prepared.probe = point.summary.extra.get("probe", {})
    run = Run(
        settings=settings,
        kind=CENTRALIZED,
        output_dir=out,
        label_map=prepared.splits.label_map,
        title=f"centralised, {data_label(settings.dataset)}, {model_label(settings.model)}",
        describe=lambda: describe(settings, prepared),
        extra=checkpoint_extra(settings, prepared.splits.label_map.names, prepared.model),
    )
    run.begin(point, data=prepared.splits.stats)
    train(settings, prepared, run, point=point)
    return run.end(prepared.model.trainable_state_dict()).to_dict()


@dataclass
class Prepared:
    """What a centralised run trains and evaluates: splits, model, training data, held out."""

    splits: DataSplits
    model: CaRRetriever
    #: The training split's features or token ids (``None``: MIPS on the frozen encoder).
    train_data: LocalData | None
    held_out: HeldOut
    feature_seconds: float
    #: The probe (``train.probe_epochs``): ``history``, each epoch's train loss and validation
    #: top-1 and loss, and ``selected``, the epoch the run starts from; empty without one.
    probe: dict[str, Any] = dataclasses.field(default_factory=dict)


def prepare(settings: Settings, *, probe: bool = True) -> Prepared:
    """The splits, their features (the encoder is loaded only if one is not cached; MIPS
    scores held-out queries against documents and encodes no training query), the model (with
    kNN's memory, and, with ``probe``, the probed head of ``train.probe_epochs``)."""
    splits = load_splits(settings.dataset, seed=settings.seed)
    start = time.perf_counter()  # the features' time: reading the data is not in it
    lazy = LazyRetriever(settings, splits)
    # nothing to train and nothing to remember (MIPS): no training query is encoded
    queries_unused = nothing_to_train(settings) and not settings.head.kind.traits.memory
    train_data = (
        None
        if queries_unused
        else prepare_for(
            settings,
            splits.train["text"],
            splits.train["label"],
            get_model=lazy,
            desc="train features",
        )
    )
    held_out = HeldOut.prepare(settings, splits, get_model=lazy)
    if lazy.model is not None:
        model = lazy()
    else:  # every feature was cached: the same head (same seed), no encoder
        features = (train_data or held_out.test).features
        assert features is not None
        size = int(features.shape[1])
        labels = len(splits.label_map)
        model = build_retriever(settings, labels, hidden_size=size, documents=lazy.documents)
    if model.kind.traits.memory:
        assert train_data is not None and train_data.features is not None
        model.set_memory(train_data.features, train_data.labels)
    probed = (
        probe_head(settings, model, splits)
        if probe and settings.train.probe_epochs and model.mode is Mode.ADAPTER_CLASSIFIER
        else {}
    )
    return Prepared(splits, model, train_data, held_out, time.perf_counter() - start, probed)


def train(
    settings: Settings, prepared: Prepared, run: Run, *, point: ResumePoint | None = None
) -> None:
    """The starting point (evaluated first, a candidate for best), then the epochs until
    ``train.patience`` epochs pass without a better one. ``point``: resume after it."""
    model, held_out = prepared.model, prepared.held_out
    epochs = 0 if nothing_to_train(settings) else settings.train.epochs
    if point is not None:
        model.load_trainable_state_dict(point.checkpoint.state)
    else:
        tick = time.perf_counter()
        metrics = held_out.evaluate(model, settings)
        start = RoundRow(round=0, epochs=0, metrics=metrics, seconds=time.perf_counter() - tick)
    if epochs == 0:  # the starting point is the run's only row, its best and final
        run.initial = start
        run.record(start, model.trainable_state_dict())
        log.info(
            "%s (nothing to train): test top1 %.4f mrr %.4f",
            model.kind.value,
            metrics["test_top1"],
            metrics["test_mrr"],
        )
        return
    if point is None:
        run.start(start, model.trainable_state_dict())
    optimizer = make_optimizer(model, settings.train)
    if point is not None and point.optimizer is not None:
        load_optimizer_tensors(optimizer, point.optimizer)
    assert prepared.train_data is not None
    first = 0 if point is None else point.done
    if point is not None and (point.finished or run.stop_if_stalled(point.done)):
        return  # its end was not written: the run writes it
    for epoch in range(first, epochs):
        tick = time.perf_counter()
        result = one_epoch(settings, model, prepared.train_data, optimizer, epoch, desc="epoch")
        row = RoundRow(
            round=epoch + 1,
            epochs=epoch + 1,
            train_loss=result.loss,
            train_accuracy=result.accuracy,
            metrics=held_out.evaluate(model, settings),
            seconds=time.perf_counter() - tick,
        )
        run.record(row, model.trainable_state_dict(), optimizer=optimizer)
        if run.stop_if_stalled(epoch + 1):
            break


def describe(settings: Settings, prepared: Prepared) -> RunSummary:
    """The centralised summary's fields beside its rows: sizes, times, selection, data."""
    return RunSummary(
        kind="centralized",
        clients=1,
        mode=settings.train.mode,
        head=settings.head.kind,
        num_labels=len(prepared.splits.label_map),
        final=None,
        best=None,
        feature_seconds=prepared.feature_seconds,
        total_seconds=0.0,
        train_examples=len(prepared.splits.train),
        test_examples=len(prepared.held_out.test),
        selection=prepared.held_out.selection,
        data=prepared.splits.stats,
        extra={"probe": prepared.probe} if prepared.probe else {},
    )


def check_no_dp(settings: Settings) -> None:
    """Refuse DP settings this loop would silently ignore (``ValueError``), before any work:
    every mode whose ``one_machine`` is not the epoch loop."""
    mode = MODES[settings.dp.mode]
    if mode.one_machine != "epochs":
        fix = (
            f"car-fl train dp={settings.dp.mode} trains it as a federation of one node "
            "(car_fl.simulation.centralized_dp)"
            if mode.one_machine == "one node"
            else f"dp={settings.dp.mode} is {mode.one_machine}"
        )
        raise ValueError(
            f"this centralised loop does not train with differential privacy, and "
            f"dp={settings.dp.mode} would be ignored; run it with dp=none, or: {fix}"
        )

"""Centralised training: the whole training split on one machine, one row of metrics per epoch.

What ``car-fl train`` and ``python -m car_fl.centralized`` run: the federation's reference.
Writes ``config.yaml``, ``metrics.json``/``metrics.csv`` (same format as a federation, one
"round" per epoch), ``curves.png`` and ``checkpoints/{best,final}`` to ``output_dir``, also for
a run that trains nothing (MIPS, kNN). The starting point (epoch 0, the untrained head) is
evaluated first and may be selected as best: a trained head is kept only when it is better on
validation; the summary's ``initial`` holds its metrics beside ``best``. After every epoch the
metrics files and ``checkpoints/last`` are written again, so that ``resume=`` can continue a
run that was stopped (:mod:`car_fl.standalone.resume`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from car_fl.common.io import atomic_write_text
from car_fl.data.splits import DataSplits, load_splits
from car_fl.model.build import build_retriever
from car_fl.model.features import LocalData, prepare_for
from car_fl.model.retriever import CaRRetriever
from car_fl.model.sources import check_sources
from car_fl.results.plots import data_label, model_label
from car_fl.results.recorder import Recorder
from car_fl.results.rows import RoundRow, RunSummary
from car_fl.serving.checkpoint import checkpoint_extra
from car_fl.settings.compose import settings_to_yaml
from car_fl.settings.schema import DPMode, HeadKind, Mode, Settings, trains_nothing
from car_fl.standalone.resume import (
    LAST,
    EpochPoint,
    check_same_run,
    load_epoch_point,
    load_optimizer_tensors,
    save_last,
)
from car_fl.training.evaluation import HeldOut, LazyRetriever
from car_fl.training.probe import probe_head
from car_fl.training.train import make_optimizer, one_epoch

log = logging.getLogger(__name__)


def run_centralized(settings: Settings, output_dir: str | Path) -> dict[str, Any]:
    """Train for ``train.epochs`` epochs, evaluating after each; returns the summary.

    Centralised training does not implement differential privacy: any ``dp`` mode other than
    ``none`` is refused here, before any work, rather than trained without it. With
    ``settings.resume`` (a run's folder) the run goes on there after its last epoch.
    """
    check_no_dp(settings)
    resume_dir = Path(settings.resume) if settings.resume else None
    point = load_epoch_point(resume_dir, settings) if resume_dir is not None else None
    check_sources(settings)  # seconds, not a minute of Hub retries, when offline
    # a resumed run's config.yaml is rewritten only once its data is found to be the same
    out = write_config(settings, output_dir, write=point is None)
    start = time.perf_counter() - (point.saved.summary.total_seconds if point is not None else 0.0)
    run = prepare(settings, probe=point is None)
    extra = checkpoint_extra(settings, run.splits.label_map.names, run.model)
    if point is not None:
        assert resume_dir is not None
        labels, stats = run.splits.label_map, run.splits.stats
        check_same_run(resume_dir, point, data=stats, labels=labels, extra=extra)
        out = write_config(settings, resume_dir, log_it=False)
        run.probe = point.probe
    recorder = Recorder(
        settings=settings,
        output_dir=out,
        label_map=run.splits.label_map,
        unit="epoch",
        title=f"centralised, {data_label(settings.dataset)}, {model_label(settings.model)}",
        extra=extra,
    )
    initial = train(settings, run, recorder, point=point, started=start)
    recorder.save_final(run.model.trainable_state_dict())
    summary = summarise(settings, run, recorder, initial, seconds=time.perf_counter() - start)
    summary.complete = True
    recorder.write(summary)
    final, best = summary.final, summary.best
    assert final is not None and best is not None
    log.info(
        "final test top1 %.4f; best on validation after epoch %d: test top1 %.4f (starting "
        "point: val top1 %s, test top1 %.4f); results: %s",
        final.metrics["test_top1"],
        best.round,
        best.metrics["test_top1"],
        f"{initial.metrics['val_top1']:.4f}" if "val_top1" in initial.metrics else "-",
        initial.metrics["test_top1"],
        out,
    )
    return summary.to_dict()


def write_config(
    settings: Settings, output_dir: str | Path, *, write: bool = True, log_it: bool = True
) -> Path:
    """The run's folder, with its resolved ``config.yaml`` (if ``write``; logged if
    ``log_it``)."""
    out = Path(output_dir)
    config_yaml = settings_to_yaml(settings)
    if log_it:  # the whole YAML at debug: a run's first screen is its progress, not ~150 lines
        log.debug("resolved configuration:\n%s", config_yaml)
    if write:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.yaml", config_yaml)
        if log_it:
            log.info("resolved configuration: %s", out / "config.yaml")
    return out


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
    frozen_mips = trains_nothing(settings) and settings.head.kind is HeadKind.MIPS
    train_data = (
        None
        if frozen_mips
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
    if model.kind is HeadKind.KNN:
        assert train_data is not None and train_data.features is not None
        model.set_memory(train_data.features, train_data.labels)
    probed = (
        probe_head(settings, model, splits)
        if probe and settings.train.probe_epochs and model.mode is Mode.ADAPTER_CLASSIFIER
        else {}
    )
    return Prepared(splits, model, train_data, held_out, time.perf_counter() - start, probed)


def train(
    settings: Settings,
    run: Prepared,
    recorder: Recorder,
    *,
    point: EpochPoint | None = None,
    started: float | None = None,
) -> RoundRow:
    """The starting point (evaluated first, a candidate for best: selection never keeps a
    trained head worse on validation than the one it started from), then the epochs, until
    ``train.patience`` epochs pass without a better one; none for MIPS on the frozen encoder
    and kNN (one evaluation). ``point``: go on after a stopped run's last epoch. Each epoch
    rewrites the metrics files (``complete: false``; ``started``: the run's start on
    ``time.perf_counter``) and ``checkpoints/last``. Returns the starting point's row."""
    model, held_out = run.model, run.held_out
    epochs = 0 if trains_nothing(settings) else settings.train.epochs
    if point is not None:
        saved = point.saved
        start = RoundRow(round=0, epochs=0, metrics=saved.initial, seconds=0.0)
        recorder.resume(saved.history, saved.initial)
        model.load_trainable_state_dict(saved.checkpoint.state)
        log.info("resumed after epoch %d of %d", point.epoch, epochs)
    else:
        tick = time.perf_counter()
        metrics = held_out.evaluate(model, settings)
        start = RoundRow(round=0, epochs=0, metrics=metrics, seconds=time.perf_counter() - tick)
    if epochs == 0:  # the starting point is the run's only row, its best and final
        recorder.record(start, model.trainable_state_dict())
        log.info(
            "%s (nothing to train): test top1 %.4f mrr %.4f",
            model.kind.value,
            start.metrics["test_top1"],
            start.metrics["test_mrr"],
        )
        return start
    if point is None:
        recorder.start(start, model.trainable_state_dict())
    optimizer = make_optimizer(model, settings.train)
    if point is not None:
        load_optimizer_tensors(optimizer, point.optimizer)
    assert run.train_data is not None
    started = time.perf_counter() if started is None else started
    first = 0 if point is None else epochs if point.finished else point.epoch
    for epoch in range(first, epochs):
        tick = time.perf_counter()
        result = one_epoch(settings, model, run.train_data, optimizer, epoch, desc="epoch")
        row = RoundRow(
            round=epoch + 1,
            epochs=epoch + 1,
            train_loss=result.loss,
            train_accuracy=result.accuracy,
            metrics=held_out.evaluate(model, settings),
            seconds=time.perf_counter() - tick,
        )
        state = model.trainable_state_dict()
        recorder.record(row, state)
        seconds = time.perf_counter() - started
        # the row first: a run stopped between the two trains this epoch again on resume
        recorder.write(summarise(settings, run, recorder, start, seconds=seconds), plot=False)
        save_last(recorder.checkpoints / LAST, recorder.checkpoint(state, row), optimizer)
        if recorder.stalled(settings.train.patience):
            log.info(
                "early stop after epoch %d: validation has not improved for %d epochs "
                "(train.patience); best: epoch %d",
                epoch + 1,
                settings.train.patience,
                recorder.best.round if recorder.best else 0,
            )
            break
    return start


def summarise(
    settings: Settings, run: Prepared, recorder: Recorder, initial: RoundRow, *, seconds: float
) -> RunSummary:
    """The run's summary: its rows' final and best, sizes, times, selection, data (``complete``
    false: the caller says when the run ended)."""
    final, best = recorder.history[-1], recorder.best
    assert best is not None
    # stopped early: out of patience before train.epochs (a run that trains nothing never is)
    early = final.round < settings.train.epochs and not trains_nothing(settings)
    return RunSummary(
        kind="centralized",
        clients=1,
        mode=settings.train.mode,
        head=settings.head.kind,
        epochs=final.epochs,
        num_labels=len(run.splits.label_map),
        initial=initial.metrics,
        final=final,
        best=best,
        feature_seconds=run.feature_seconds,
        total_seconds=seconds,
        train_examples=len(run.splits.train),
        test_examples=len(run.held_out.test),
        selection=run.held_out.selection,
        data=run.splits.stats,
        stopped_early=(
            final.round if early and recorder.stalled(settings.train.patience) else None
        ),
        complete=False,
        extra={"probe": run.probe} if run.probe else {},
    )


def check_no_dp(settings: Settings) -> None:
    """Refuse DP settings this loop would silently ignore (``ValueError``), before any work.

    ``dp=record`` trains here through :mod:`car_fl.simulation.centralized_dp` (``car-fl train``
    and ``python -m car_fl.centralized`` go there); ``dp=fixed`` and ``dp=adaptive`` protect an
    update from the server that aggregates it, and one machine has no such server.
    """
    if settings.dp.enabled:
        mode = settings.dp.mode.value
        fix = (
            "car-fl train dp=record trains it with DP-SGD (car_fl.simulation.centralized_dp)"
            if settings.dp.mode is DPMode.RECORD
            else f"dp={mode} is local DP, which protects an update from the server: train it "
            "federated (car-fl run / flwr run .), or use dp=record (DP-SGD) on one machine"
        )
        raise ValueError(
            f"this centralised loop does not train with differential privacy, and dp={mode} "
            f"would be ignored; run it with dp=none, or: {fix}"
        )

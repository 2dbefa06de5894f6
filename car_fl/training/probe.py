"""Linear probing before fine-tuning (Kumar et al., 2022): the head alone on frozen features,
the epoch validation selects kept, before adapter + classifier trains both through the LM.

``train.probe_epochs`` centrally; ``fl.probe_rounds`` in a federation, where a probe round's
DP release covers the head alone and the server's adapter is added back after it, un-noised
(noise on it would tell the server how many steps the node took).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from car_fl.model.feature_cache import FeatureCache
from car_fl.model.features import LocalData, prepare_data
from car_fl.model.retriever import CaRRetriever
from car_fl.privacy.mechanism import split_adapter
from car_fl.results.rows import RoundRow
from car_fl.results.run import CENTRALIZED, Run
from car_fl.settings.schema import Mode, Settings
from car_fl.training.train import evaluate, make_optimizer, one_epoch

if TYPE_CHECKING:  # datasets: not on a client whose round reads cached features
    from car_fl.data.splits import DataSplits

log = logging.getLogger(__name__)


def probe_head(settings: Settings, model: CaRRetriever, splits: DataSplits) -> dict[str, Any]:
    """Up to ``train.probe_epochs`` epochs of the head alone on cached frozen features, each
    scored on validation (epoch 0 too); the best head is kept (the last without validation),
    ``train.patience`` applies. Returns ``history`` and ``selected``."""

    def features(split: str) -> LocalData:
        return prepare_data(
            getattr(splits, split)["text"],
            getattr(splits, split)["label"],
            mode=Mode.CLASSIFIER,
            model_cfg=settings.model,
            device=settings.device,
            get_model=lambda: model,
            cache=FeatureCache(settings.cache_dir),
            batch_size=settings.train.feature_batch_size,
            progress=settings.progress,
            desc=f"probe {split} features",
        )

    data = features("train")
    validation = features("validation") if len(splits.validation) else None
    optimizer = make_optimizer(model, settings.train)
    run = Run(settings, CENTRALIZED, None, splits.label_map)  # in memory: selection, patience
    rows: list[dict[str, float]] = []
    for epoch in range(settings.train.probe_epochs + 1):  # 0: the untrained head, as in CaR
        row: dict[str, float] = {"epoch": epoch}
        if epoch:
            result = one_epoch(settings, model, data, optimizer, epoch - 1, desc="probe")
            row["train_loss"] = result.loss
        if validation is not None:
            scores = evaluate(
                model,
                validation,
                batch_size=settings.train.eval_batch_size,
                top_k=settings.eval.top_k,
            )
            row.update(val_top1=scores["top1"], val_loss=scores["loss"])
        rows.append(row)
        metrics = {k: v for k, v in row.items() if k.startswith("val_")}
        step = RoundRow(round=epoch, epochs=epoch, metrics=metrics, seconds=0.0)
        state = model.trainable_state_dict()
        if epoch:
            run.record(step, state)
        else:
            run.start(step, state)
        if run.stalled() is not None:
            break
    assert run.best is not None and run.best_state is not None
    model.load_trainable_state_dict(run.best_state)
    best = rows[run.best.round]
    log.info(
        "probed the head for %d epochs on frozen features; the adapter starts from probe "
        "epoch %d (val top1 %s)",
        len(rows) - 1,
        best["epoch"],
        f"{best['val_top1']:.4f}" if "val_top1" in best else "-: no validation split",
    )
    return {"selected": best["epoch"], "history": rows}


def probe_round(settings: Settings, server_round: int) -> bool:
    """Whether federated round ``server_round`` is a probe round (the first ``fl.probe_rounds``)."""
    adapter = settings.train.mode is Mode.ADAPTER_CLASSIFIER
    return adapter and server_round <= settings.fl.probe_rounds


def round_settings(settings: Settings, server_round: int) -> Settings:
    """Classifier mode in a probe round (the head alone), else ``settings`` as they are."""
    if not probe_round(settings, server_round):
        return settings
    return replace(settings, train=replace(settings.train, mode=Mode.CLASSIFIER))


def keep_adapter(
    state: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A probe round's trained state with the server's adapter added back, untouched."""
    adapter, _ = split_adapter(global_state)
    if not adapter:
        raise ValueError(
            "a probe round (fl.probe_rounds) of adapter + CaR needs the adapter among the "
            f"tensors the server sent; got {sorted(global_state)}"
        )
    return {**{k: global_state[k].detach().clone() for k in adapter}, **state}

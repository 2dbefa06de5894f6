"""Local training and evaluation of the CaR retriever, in both modes.

``classifier``: the head trains on cached pooled features (one encoder pass, ever).
``adapter+classifier``: the adapter and the head train through the frozen encoder; each batch
is padded to its own length. The order of examples in epoch ``e`` depends only on
``(seed, e)``, so a run split into rounds of local epochs sees the same order as one long run.

Evaluation on the held-out splits: validation selects the model, test is reported.
:class:`HeldOut` prepares both splits once and evaluates a model on them (the centralised run
after each epoch; the server after each round, :mod:`car_fl.server.federation`).

Retrieval metrics: top-K accuracy, Recall@K, MRR, nDCG@10, macro-F1. Every metric is a function
of the true label's rank per query (:func:`rank_of_true`), so an evaluation keeps one rank and
one prediction per query. With one relevant document per query Recall@K is top-K accuracy and
nDCG@10 is 1/log2(1 + rank) for a rank of at most 10, else 0.

Linear probing before fine-tuning (Kumar et al., 2022; :func:`probe_round`): the head alone on
frozen features, the epoch validation selects kept, before adapter + classifier trains both
through the LM. ``train.probe_epochs`` centrally; ``fl.probe_rounds`` in a federation, where
a probe round's DP release covers the head alone and the server's adapter is added back after
it, un-noised (noise on it would tell the server how many steps the node took).

Threads where they pay: for a small head the intra-op hand-off costs more than the arithmetic
(docs/performance.md#threads-one-for-small-steps), so :func:`threads_for` runs a loop on one
thread below :data:`SMALL_STEP`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from car_fl.common.progress import bar
from car_fl.model.feature_cache import FeatureCache
from car_fl.model.features import (
    LocalData,
    extract_features,
    prepare_data,
    prepare_for,
    split_texts,
)
from car_fl.model.retriever import CaRRetriever, build_retriever
from car_fl.privacy.mechanism import ADAPTER_PREFIX, split_adapter
from car_fl.results.rows import RoundRow
from car_fl.results.run import CENTRALIZED, Run, eval_row
from car_fl.settings.schema import Lexical, Mode, OptimizerKind, Settings, TrainConfig

if TYPE_CHECKING:
    from car_fl.data.splits import DataSplits


log = logging.getLogger(__name__)

#: Multiply-adds per step below which one thread was faster (docs/performance.md, "Threads").
SMALL_STEP = 2_000_000


def head_work(parameters: int, batch: int) -> int:
    """Multiply-adds of one step of a head with ``parameters`` weights over ``batch`` rows."""
    return parameters * batch


@contextlib.contextmanager
def threads_for(work: int) -> Iterator[int]:
    """torch's intra-op threads set for steps of ``work`` multiply-adds inside the block (one
    below :data:`SMALL_STEP`), restored after it; yields the number used."""
    previous = torch.get_num_threads()
    threads = 1 if work < SMALL_STEP else previous
    if threads != previous:
        torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        if threads != previous:
            torch.set_num_threads(previous)


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


def rank_of_true(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1-based rank of the true label among each row's logits; ties count against the model."""
    true = logits.gather(1, labels.view(-1, 1))  # (batch, 1)
    return (logits >= true).sum(dim=1)


def macro_f1(predictions: torch.Tensor, labels: torch.Tensor, num_labels: int) -> float:
    """Unweighted mean of per-label F1 over the labels that occur in ``labels`` or predictions."""
    predictions, labels = predictions.long().cpu(), labels.long().cpu()
    predicted = torch.bincount(predictions, minlength=num_labels).double()
    actual = torch.bincount(labels, minlength=num_labels).double()
    tp = torch.bincount(labels[predictions == labels], minlength=num_labels).double()
    present = (predicted > 0) | (actual > 0)
    if not bool(present.any()):
        return float("nan")
    precision = tp / predicted.clamp_min(1.0)
    recall = tp / actual.clamp_min(1.0)
    f1 = torch.where(tp > 0, 2 * precision * recall / (precision + recall).clamp_min(1e-300), 0.0)
    return float(f1[present].mean())


#: Recall@K and nDCG@K reported beside the top-K accuracies.
RECALL_K = (1, 5, 10)
NDCG_K = 10


def rank_metrics(
    rank: torch.Tensor,
    *,
    top_k: list[int],
    predictions: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    num_labels: int | None = None,
    loss: float | None = None,
) -> dict[str, float]:
    """Metrics of 1-based ranks: ``loss``, ``top{k}``, ``recall@{k}``, ``mrr``, ``ndcg@10``, F1."""
    out: dict[str, float] = {}
    if loss is not None:
        out["loss"] = loss
    r = rank.double()
    empty = len(r) == 0

    def share(mask: torch.Tensor) -> float:
        return float("nan") if empty else float(mask.double().mean())

    for k in sorted({1, *top_k}):
        out[f"top{k}"] = share(r <= k)
    for k in RECALL_K:
        out[f"recall@{k}"] = share(r <= k)
    out["mrr"] = float("nan") if empty else float((1.0 / r).mean())
    gain = torch.where(r <= NDCG_K, 1.0 / torch.log2(r + 1.0), torch.zeros_like(r))
    out[f"ndcg@{NDCG_K}"] = float("nan") if empty else float(gain.mean())
    if predictions is not None and labels is not None and num_labels is not None:
        out["macro_f1"] = macro_f1(predictions, labels, num_labels)
    return out


class LazyRetriever:
    """The run's retriever, built (encoder loaded) only when a feature is not cached."""

    def __init__(self, settings: Settings, splits: DataSplits) -> None:
        self.settings, self.names = settings, splits.label_map.names
        self.documents = split_texts(settings, splits)
        self.model: CaRRetriever | None = None

    def __call__(self) -> CaRRetriever:
        if self.model is None:
            self.model = build_retriever(self.settings, len(self.names), documents=self.documents)
        return self.model


@dataclass
class HeldOut:
    """Validation (``None`` without one: ``dataset.val_fraction=0``) and test examples. A corpus
    with new documents also reports ``new_*`` and ``old_*`` metrics: on the queries of documents
    that had no training query, and on the others."""

    test: LocalData
    validation: LocalData | None
    new_documents: frozenset[int] = frozenset()

    def subsets(self, data: LocalData) -> dict[str, torch.Tensor]:
        """``new`` and ``old`` query masks of ``data`` (none without new documents)."""
        if not self.new_documents:
            return {}
        new = torch.isin(data.labels, torch.tensor(sorted(self.new_documents)))
        return {"new": new, "old": ~new}

    @classmethod
    def prepare(
        cls,
        settings: Settings,
        splits: DataSplits,
        *,
        get_model: Callable[[], CaRRetriever],
        desc: str = "",
    ) -> HeldOut:
        """Features (or token ids) of the test and validation splits; ``desc`` prefixes the bars."""
        test = prepare_for(
            settings,
            splits.test["text"],
            splits.test["label"],
            get_model=get_model,
            desc=f"{desc}test features",
        )
        validation = (
            prepare_for(
                settings,
                splits.validation["text"],
                splits.validation["label"],
                get_model=get_model,
                desc=f"{desc}validation features",
            )
            if len(splits.validation)
            else None
        )
        if settings.head.lexical is not Lexical.NONE:  # the fused ranking reads the texts
            test = dataclasses.replace(test, texts=tuple(splits.test["text"]))
            if validation is not None:
                validation = dataclasses.replace(validation, texts=tuple(splits.validation["text"]))
        return cls(test=test, validation=validation, new_documents=splits.new_documents)

    @property
    def selection(self) -> str:
        """How the best model is chosen (the summary's ``selection``)."""
        return "validation" if self.validation is not None else "final (no validation split)"

    def evaluate(self, model: CaRRetriever, settings: Settings) -> dict[str, float]:
        """``val_*`` and ``test_*`` metrics of ``model``."""
        return eval_row(
            self.metrics_on(self.validation, model, settings), self.on_test(model, settings)
        )

    def metrics_on(
        self, data: LocalData | None, model: CaRRetriever, settings: Settings
    ) -> dict[str, float] | None:
        """The metrics of ``model`` on ``data`` (unprefixed), or None without data."""
        if data is None:
            return None
        return evaluate(
            model,
            data,
            batch_size=settings.train.eval_batch_size,
            top_k=settings.eval.top_k,
            subsets=self.subsets(data),
        )

    def on_test(self, model: CaRRetriever, settings: Settings) -> dict[str, float]:
        """The metrics of ``model`` on the test split (unprefixed)."""
        metrics = self.metrics_on(self.test, model, settings)
        assert metrics is not None
        return metrics

    def sample_validation(self, size: int, *, seed: int) -> HeldOut:
        """The same splits with validation cut to ``size`` examples drawn with ``seed`` (kept
        in their order); as it is when ``size`` is 0 or not smaller than validation."""
        if self.validation is None or size == 0 or size >= len(self.validation):
            return self
        generator = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(len(self.validation), generator=generator)[:size]
        positions = sorted(int(i) for i in chosen)
        return HeldOut(self.test, self.validation.select(positions), self.new_documents)


#: The per-document rows of document heads (their own learning rate, ``train.rows_lr``).
ROW_PREFIXES = ("head.rows", "head.experts.")


def make_optimizer(model: CaRRetriever, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``torch.optim``'s SGD, Adam or AdamW over the trainable parameters only: the head, the
    document rows and the adapter each with its learning rate."""
    params = model.trainable_parameters()
    rows = [p for name, p in params.items() if name.startswith(ROW_PREFIXES)]
    head = [
        p
        for name, p in params.items()
        if not name.startswith(ADAPTER_PREFIX) and not name.startswith(ROW_PREFIXES)
    ]
    groups: list[dict[str, Any]] = [{"params": head, "lr": cfg.lr}] if head else []
    if rows:
        groups.append({"params": rows, "lr": cfg.rows_lr or cfg.lr})
    adapter = [p for name, p in params.items() if name.startswith(ADAPTER_PREFIX)]
    if adapter:
        groups.append({"params": adapter, "lr": cfg.adapter_lr or cfg.lr})
    if not groups:
        raise ValueError(
            f"nothing to train: head.kind={model.kind.value} in mode={model.mode.value} has no "
            "trainable parameter (evaluate it directly)"
        )
    kind = OptimizerKind.parse("train.optimizer", cfg.optimizer)
    if kind is OptimizerKind.SGD:
        return torch.optim.SGD(
            groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    adam = torch.optim.AdamW if kind is OptimizerKind.ADAMW else torch.optim.Adam
    return adam(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


def epoch_seed(seed: int, epoch: int) -> int:
    """The RNG seed of global epoch ``epoch`` (0-based): data order and dropout."""
    return (seed * 1_000_003 + epoch * 7_919) % (2**63 - 1)


def epoch_order(n: int, *, seed: int, epoch: int) -> torch.Tensor:
    """A permutation of ``range(n)`` that depends only on ``(seed, epoch)``."""
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(n, generator=generator)


@dataclass
class EpochResult:
    loss: float
    accuracy: float
    examples: int
    steps: int


StepHook = Callable[[CaRRetriever], None]


def train_epoch(
    model: CaRRetriever,
    data: LocalData,
    optimizer: torch.optim.Optimizer,
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    progress: bool = True,
    desc: str = "train",
    after_step: StepHook | None = None,
    prox_mu: float = 0.0,
    anchor: Mapping[str, torch.Tensor] | None = None,
) -> EpochResult:
    """One pass over ``data`` in the order of ``epoch_order(seed, epoch)``. ``after_step`` runs
    after every optimizer step. ``prox_mu`` > 0 adds FedProx's μ/2·‖θ − ``anchor``‖² to the
    minimised loss (the reported loss stays the task loss)."""
    proximal = ProximalTerm(model, anchor, prox_mu) if prox_mu > 0 else None
    if len(data) == 0:
        raise ValueError("cannot train on an empty dataset")
    model.train()
    torch.manual_seed(epoch_seed(seed, epoch))  # dropout
    device = model.device
    order = epoch_order(len(data), seed=seed, epoch=epoch)
    features = data.features.to(device) if data.features is not None else None
    labels_all = data.labels.to(device)
    total_loss, correct, steps = 0.0, 0, 0
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    with threads_for(step_multiply_adds(model, features, batch_size)):
        for batch in bar(batches, desc=desc, unit="step", enabled=progress):
            labels = labels_all[batch.to(device)]
            if features is not None:
                logits, loss = model(features=features[batch.to(device)], labels=labels)
            else:
                assert data.input_ids is not None
                ids, mask = model.encoder.pad([data.input_ids[i] for i in batch.tolist()])
                logits, loss = model(ids, mask, labels=labels)
            assert loss is not None
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"training loss became {loss.item()} at step {steps}; lower train.lr"
                )
            optimizer.zero_grad(set_to_none=True)
            objective = loss + proximal() if proximal is not None else loss
            penalty = model.adapter_penalty()
            (objective + penalty if penalty is not None else objective).backward()
            optimizer.step()
            if after_step is not None:
                after_step(model)
            total_loss += float(loss.detach()) * len(batch)
            correct += int((logits.detach().argmax(dim=1) == labels).sum())
            steps += 1
    model.eval()
    return EpochResult(
        loss=total_loss / len(data), accuracy=correct / len(data), examples=len(data), steps=steps
    )


def train_epoch_dpsgd(
    model: CaRRetriever,
    data: LocalData,
    optimizer: torch.optim.Optimizer,
    *,
    sample_rate: float,
    clip: float,
    noise_multiplier: float,
    steps: int,
    seed: int,
    epoch: int,
    batches: Sequence[torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    progress: bool = True,
    desc: str = "dp-sgd",
    population: int | None = None,
    adapter_clip: float | None = None,
) -> EpochResult:
    """One epoch of record-level DP-SGD: ``steps`` Poisson-sampled steps at rate q
    (:func:`car_fl.privacy.dpsgd.dpsgd_step`), from OS entropy unless ``batches`` and
    ``generator`` (tests) are given. ``population`` (default ``len(data)``) is the n of q·n:
    examples left out still count, so nothing sent depends on how many were.
    """
    from car_fl.privacy.dpsgd import dpsgd_step, poisson_sample
    from car_fl.privacy.mechanism import seed_from_entropy

    population = len(data) if population is None else population
    if population == 0:
        raise ValueError("cannot train on an empty dataset")
    if population < len(data):
        raise ValueError(f"cannot train {len(data)} examples standing for only {population}")
    model.train()
    # dropout masks from OS entropy, never from a seed the server knows
    seed_from_entropy()
    device = model.device
    params = model.trainable_parameters()
    features = data.features.to(device) if data.features is not None else None
    planned = list(batches) if batches is not None else [None] * steps
    expected = sample_rate * population
    total_loss, correct, seen = 0.0, 0, 0
    with threads_for(step_multiply_adds(model, features, math.ceil(expected))):
        for batch in bar(planned, desc=desc, unit="step", enabled=progress):
            index = batch if batch is not None else poisson_sample(len(data), sample_rate)
            labels = data.labels[index].to(device)
            if features is not None:
                inputs: dict[str, Any] = {"features": features[index.to(device)]}
            else:
                assert data.input_ids is not None
                inputs = {"input_ids": [torch.tensor(data.input_ids[i]) for i in index.tolist()]}
            result = dpsgd_step(
                model,
                params,
                optimizer,
                labels,
                clip=clip,
                adapter_clip=adapter_clip,
                noise_multiplier=noise_multiplier,
                expected_batch_size=expected,
                generator=generator,
                penalty=model.adapter_penalty,
                **inputs,
            )
            if not all(bool(torch.isfinite(p).all()) for p in params.values()):
                raise FloatingPointError(
                    f"DP-SGD made a parameter non-finite after {seen} examples; lower train.lr"
                )
            total_loss += result.loss_sum
            correct += result.correct
            seen += result.examples
    model.eval()
    return EpochResult(
        loss=total_loss / max(seen, 1),
        accuracy=correct / max(seen, 1),
        examples=seen,
        steps=len(planned),
    )


def step_multiply_adds(model: CaRRetriever, features: torch.Tensor | None, batch: int) -> int:
    """Multiply-adds of one step on cached ``features`` (the head's, and scoring every
    label); an encoder pass (no features) counts as large (:func:`threads_for`)."""
    if features is None:
        return sys.maxsize
    head = sum(p.numel() for p in model.head.parameters())
    return head_work(head + features.shape[1] * model.num_labels, batch)


class ProximalTerm:
    """FedProx's μ/2·‖θ − θ_global‖² over the trainable parameters (Li et al., 2020)."""

    def __init__(
        self, model: CaRRetriever, anchor: Mapping[str, torch.Tensor] | None, mu: float
    ) -> None:
        if anchor is None:
            raise ValueError("the proximal term (strategy=fedprox) needs the global parameters")
        self.params = model.trainable_parameters()
        self.anchor = {
            k: anchor[k].detach().to(device=p.device, dtype=p.dtype) for k, p in self.params.items()
        }
        self.mu = mu

    def __call__(self) -> torch.Tensor:
        total = sum((p - self.anchor[k]).pow(2).sum() for k, p in self.params.items())
        return 0.5 * self.mu * torch.as_tensor(total)


def one_epoch(
    settings: Settings,
    model: CaRRetriever,
    data: LocalData,
    optimizer: torch.optim.Optimizer,
    epoch: int,
    *,
    desc: str,
) -> EpochResult:
    """One epoch of ``data`` with the run's batch size, seed and progress bar."""
    return train_epoch(
        model,
        data,
        optimizer,
        batch_size=settings.train.batch_size,
        seed=settings.seed,
        epoch=epoch,
        progress=settings.progress,
        desc=f"{desc} {epoch + 1}",
    )


def query_features(
    model: CaRRetriever, data: LocalData, *, batch_size: int, progress: bool = False
) -> torch.Tensor:
    """Pooled queries ``(n, d)``: the cached features, or encoded through the current adapter."""
    if data.features is not None:
        return data.features
    assert data.input_ids is not None
    with torch.inference_mode():
        return extract_features(
            model.encode,
            model.encoder.pad,
            data.input_ids,
            batch_size=batch_size,
            progress=progress,
            desc="eval",
        )


def evaluate(
    model: CaRRetriever,
    data: LocalData,
    *,
    batch_size: int,
    top_k: list[int],
    progress: bool = False,
    subsets: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Loss, top-K accuracy, Recall@K, MRR, nDCG@10 and macro-F1 on ``data``, one batch at a
    time. ``subsets`` (name → boolean mask) add the same metrics as ``{name}_{metric}``."""
    model.eval()
    features = query_features(model, data, batch_size=batch_size, progress=progress)
    ranks, predictions = [], []
    loss_sum = 0.0
    work = step_multiply_adds(model, features if data.features is not None else None, batch_size)
    with torch.inference_mode(), threads_for(work):
        index = model.index()
        for start in range(0, len(data), batch_size):
            batch = features[start : start + batch_size].to(model.device)
            labels = data.labels[start : start + batch_size].to(model.device)
            scores = model.score(batch, index=index).float()  # (batch, labels)
            loss_sum += float(model.head.evaluation_loss(scores, labels))  # the head's own
            if model.lexical is not None:  # the ranking a user gets: fused with the index's
                if data.texts is None:
                    raise ValueError("a retriever with a lexical index ranks by the query texts")
                scores = model.fuse(scores, data.texts[start : start + batch_size])
            ranks.append(rank_of_true(scores, labels.to(scores.device)).cpu())
            predictions.append(scores.argmax(dim=1).cpu())
    rank, predicted = torch.cat(ranks), torch.cat(predictions)
    loss = loss_sum / max(len(data), 1)
    if not math.isfinite(loss):
        log.warning("evaluation loss is %s", loss)
    out = rank_metrics(
        rank,
        top_k=top_k,
        predictions=predicted,
        labels=data.labels,
        num_labels=model.num_labels,
        loss=loss,
    )
    for name, mask in (subsets or {}).items():
        part = rank_metrics(rank[mask], top_k=top_k)
        out.update({f"{name}_{key}": value for key, value in part.items()})
    return out

"""Centralised training: the whole training split on one machine, one row of metrics per epoch.

    python -m car_fl.centralized dataset=sms_spam model=tinyllama mode=classifier

Writes ``config.yaml``, ``metrics.json``/``metrics.csv`` (same format as a federation, one
"round" per epoch), ``curves.png`` and ``checkpoints/{best,final}`` to the Hydra run directory
(or ``output_dir``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from car_fl.checkpoint import Checkpoint, save_checkpoint
from car_fl.config import (
    HeadKind,
    Settings,
    conf_dir,
    settings_to_yaml,
    to_settings,
    trains_nothing,
)
from car_fl.data import load_splits
from car_fl.features import prepare_for
from car_fl.io import atomic_write_text
from car_fl.model import CaRRetriever, build_retriever
from car_fl.report import plot_curves, write_metrics
from car_fl.retrieval import label_documents
from car_fl.selection import eval_row, is_better
from car_fl.train import evaluate, make_optimizer, train_epoch

log = logging.getLogger(__name__)


def round_line(row: dict[str, Any], *, unit: str = "round") -> str:
    """The fixed-format log line of one round (or epoch)."""
    val = (
        f"val loss {row['val_loss']:.4f} top1 {row['val_top1']:.4f} | " if "val_top1" in row else ""
    )
    return (
        f"{unit} {row['round']:>3d} | train loss {row.get('train_loss', float('nan')):.4f} "
        f"acc {row.get('train_accuracy', float('nan')):.4f} | {val}"
        f"test loss {row['test_loss']:.4f} top1 {row['test_top1']:.4f} | {row['seconds']:.1f}s | "
        f"sent {row.get('bytes_sent', 0):,} B recv {row.get('bytes_received', 0):,} B"
        + (f" | ε {row['epsilon']:.4g}" if row.get("dp_active") else "")
    )


def run_centralized(settings: Settings, output_dir: str | Path) -> dict[str, Any]:
    """Train for ``train.epochs`` epochs, evaluating after each; returns the summary."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_yaml = settings_to_yaml(settings)
    log.info("resolved configuration:\n%s", config_yaml)
    atomic_write_text(out / "config.yaml", config_yaml)

    # Data and model: the encoder is loaded only if a feature is not cached (or for MIPS)
    splits = load_splits(settings.dataset, seed=settings.seed)
    names = splits.label_map.names
    documents = label_documents(names, settings.dataset.label_texts)
    loaded: list[CaRRetriever] = []

    def with_encoder() -> CaRRetriever:
        if not loaded:
            loaded.append(build_retriever(settings, len(names), documents=documents))
        return loaded[0]

    start = time.perf_counter()
    train_data = prepare_for(
        settings,
        splits.train["text"],
        splits.train["label"],
        get_model=with_encoder,
        desc="train features",
    )
    test_data = prepare_for(
        settings,
        splits.test["text"],
        splits.test["label"],
        get_model=with_encoder,
        desc="test features",
    )
    val_data = (
        prepare_for(
            settings,
            splits.validation["text"],
            splits.validation["label"],
            get_model=with_encoder,
            desc="validation features",
        )
        if len(splits.validation)
        else None
    )
    if loaded or HeadKind(settings.head.kind) is HeadKind.MIPS:  # MIPS: label documents
        model = with_encoder()
    else:  # every feature was cached: the same head (same seed), no encoder
        assert train_data.features is not None
        hidden = int(train_data.features.shape[1])
        model = build_retriever(settings, len(names), hidden_size=hidden)
    if model.kind is HeadKind.KNN:
        assert train_data.features is not None
        model.set_memory(train_data.features, train_data.labels)
    feature_seconds = time.perf_counter() - start

    def evaluate_splits() -> dict[str, float]:
        """Validation (model selection) and test (reporting) metrics of the current model."""
        batch, top_k = settings.train.eval_batch_size, settings.eval.top_k
        return eval_row(
            evaluate(model, val_data, batch_size=batch, top_k=top_k) if val_data else None,
            evaluate(model, test_data, batch_size=batch, top_k=top_k),
        )

    # Epochs (none for MIPS on the frozen encoder and kNN: one evaluation)
    history: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    ckpt_dir = out / "checkpoints"
    epochs = 0 if trains_nothing(settings) else settings.train.epochs
    if epochs == 0:
        tick = time.perf_counter()
        best = {"round": 0, "epochs": 0, **evaluate_splits()}
        best.update(seconds=time.perf_counter() - tick, bytes_sent=0, bytes_received=0)
        history.append(best)
        log.info(
            "%s (nothing to train): test top1 %.4f mrr %.4f",
            model.kind.value,
            best["test_top1"],
            best["test_mrr"],
        )
    else:
        optimizer = make_optimizer(model, settings.train)
    for epoch in range(epochs):
        tick = time.perf_counter()
        result = train_epoch(
            model,
            train_data,
            optimizer,
            batch_size=settings.train.batch_size,
            seed=settings.seed,
            epoch=epoch,
            progress=settings.progress,
            desc=f"epoch {epoch + 1}",
        )
        row: dict[str, Any] = {
            "round": epoch + 1,
            "epochs": epoch + 1,
            "train_loss": result.loss,
            "train_accuracy": result.accuracy,
            **evaluate_splits(),
            "seconds": time.perf_counter() - tick,
            "bytes_sent": 0,
            "bytes_received": 0,
        }
        history.append(row)
        log.info(round_line(row, unit="epoch"))
        if is_better(row, best):  # on validation, never on test
            best = row
            save_checkpoint(ckpt_dir / "best", _checkpoint(model, splits.label_map, settings, row))

    assert best is not None
    final = history[-1]
    save_checkpoint(ckpt_dir / "final", _checkpoint(model, splits.label_map, settings, final))
    summary = {
        "kind": "centralized",
        "clients": 1,
        "mode": settings.train.mode,
        "head": settings.head.kind,
        "epochs": epochs,
        "num_labels": len(names),
        "final": final,
        "best": best,
        "feature_seconds": feature_seconds,
        "total_seconds": time.perf_counter() - start,
        "train_examples": len(train_data),
        "test_examples": len(test_data),
        "selection": "validation" if val_data else "final (no validation split)",
        "data": splits.stats,
    }
    write_metrics(out, kind="centralized", history=history, summary=summary)
    plot_curves(out, history, title=f"centralised {settings.dataset.name}", x_label="epoch")
    log.info(
        "final test top1 %.4f; best on validation after epoch %d: test top1 %.4f; results in %s",
        final["test_top1"],
        best["round"],
        best["test_top1"],
        out,
    )
    return summary


def _checkpoint(
    model: CaRRetriever, label_map: Any, settings: Settings, row: dict[str, Any]
) -> Checkpoint:
    return Checkpoint(
        state=model.trainable_state_dict(),
        label_map=label_map,
        settings=settings,
        round=int(row["round"]),
        metrics=row,
    )


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    settings = to_settings(cfg)
    run_centralized(settings, settings.output_dir or HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()

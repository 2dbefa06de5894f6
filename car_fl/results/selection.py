"""Model selection on the validation split, never on test.

Higher validation top-1 wins, then lower validation loss, then the earlier row. Without a
validation split the latest model is "best" (it equals "final").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

Row = Mapping[str, Any]
T = TypeVar("T")


def _as_scores(row: Any) -> Row:
    return row


def eval_row(validation: Mapping[str, float] | None, test: Mapping[str, float]) -> dict[str, float]:
    """Validation and test metrics side by side: ``val_top1``, ..., ``test_top1``, ..."""
    row = {f"val_{k}": float(v) for k, v in (validation or {}).items()}
    row.update({f"test_{k}": float(v) for k, v in test.items()})
    return row


def is_better(row: Row, best: Row | None) -> bool:
    """Whether ``row`` should replace ``best`` as the selected model."""
    if best is None or "val_top1" not in row or "val_top1" not in best:
        return True
    return (row["val_top1"], -row["val_loss"]) > (best["val_top1"], -best["val_loss"])


def select_best(rows: Iterable[T], *, scores: Callable[[T], Row] = _as_scores) -> T | None:
    """The row :func:`is_better` keeps when the rows arrive in order (``scores``: a row's
    ``val_*`` metrics; default: the row is a mapping of them)."""
    best: T | None = None
    for row in rows:
        if is_better(scores(row), scores(best) if best is not None else None):
            best = row
    return best


def patience_spent(since_best: int, patience: int | None) -> bool:
    """The one patience rule (``train.patience``; null: never): ``since_best`` epochs or rounds
    that count were recorded after the one validation selects."""
    return patience is not None and since_best >= patience

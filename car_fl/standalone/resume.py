"""What a centralised run adds to a resume (:mod:`car_fl.results.resume`): its optimiser.

After every epoch a run rewrites ``metrics.json`` (``complete: false`` until it ends), then
keeps ``checkpoints/last`` (the trainable tensors, and beside them the optimiser's state). A
resumed run loads both and goes on from the next epoch: each epoch's data order and dropout
depend only on the seed and the epoch (:func:`car_fl.training.train.epoch_seed`), so it ends
where an uninterrupted run would. A federation's clients start every round with a new
optimiser, so it keeps none (:mod:`car_fl.server.resume`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from car_fl.common.io import atomic_write_bytes
from car_fl.data.labels import LabelMap
from car_fl.results.checkpoint import WEIGHTS, Checkpoint, save_checkpoint
from car_fl.results.recorder import best_row, rows_since_best
from car_fl.results.resume import ResumePoint, check_run_dir, load_resume_point
from car_fl.results.rows import METRICS_JSON, RoundRow
from car_fl.results.selection import patience_spent
from car_fl.settings.schema import Settings, trains_nothing

#: ``checkpoints/last``: the state after the last epoch, what a resume continues from.
LAST = "last"
#: Settings a resumed run may change: where and how it shows its work, the device, and
#: ``train.epochs`` (raised, to train a finished run longer).
MAY_CHANGE = ("output_dir", "cache_dir", "resume", "progress", "device", "train.epochs")


def optimizer_file(epoch: int) -> str:
    """The optimiser's state after ``epoch``, beside ``checkpoints/last``'s weights (named by
    its epoch: the previous one is removed only once the new weights are written)."""
    return f"optimizer-{epoch:04d}.safetensors"


@dataclass
class EpochPoint:
    """Where a resumed centralised run continues: the run read back
    (:class:`car_fl.results.resume.ResumePoint`) and the optimiser's state of its epoch."""

    saved: ResumePoint
    optimizer: dict[str, torch.Tensor]
    #: The probe's curve (``train.probe_epochs``): the probe is not run again.
    probe: dict[str, Any] = field(default_factory=dict)
    #: Nothing is left to train (``train.epochs`` done, or ``train.patience`` ran out), but
    #: the run was stopped before its end was written: the resume writes it.
    finished: bool = False

    @property
    def epoch(self) -> int:
        return self.saved.done


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimiser's per-parameter state as flat tensors (``"<parameter>.<name>"``);
    its hyper-parameters are the run's settings and are not kept."""
    out: dict[str, torch.Tensor] = {}
    for index, values in optimizer.state_dict()["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                out[f"{index}.{name}"] = value.detach().cpu().contiguous()
            elif value is not None:
                raise TypeError(f"optimizer state {index}.{name} is not a tensor: {value!r}")
    return out


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """Restore :func:`optimizer_tensors` into ``optimizer`` (built over the same parameters);
    ``ValueError`` if they belong to other parameters."""
    content = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, _, name = key.partition(".")
        if not index.isdigit() or int(index) >= len(params):
            raise ValueError(f"optimizer state {key!r} is for a parameter this model lacks")
        param = params[int(index)]
        if value.dim() and value.shape != param.shape:
            raise ValueError(
                f"optimizer state {key!r} has shape {tuple(value.shape)}, its parameter "
                f"{tuple(param.shape)}"
            )
        state.setdefault(int(index), {})[name] = value
    content["state"] = state
    optimizer.load_state_dict(content)


def save_last(folder: Path, checkpoint: Checkpoint, optimizer: torch.optim.Optimizer) -> None:
    """``checkpoints/last``: the optimiser's state, then the epoch's checkpoint (each written
    atomically), then the previous optimiser file removed: a run stopped at any point leaves
    weights with the optimiser state of their own epoch."""
    name = optimizer_file(checkpoint.round)
    data = save(optimizer_tensors(optimizer), metadata={"epoch": str(checkpoint.round)})
    atomic_write_bytes(folder / name, data)
    save_checkpoint(folder, checkpoint)
    for old in folder.glob("optimizer-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)


def load_epoch_point(run_dir: Path, settings: Settings) -> EpochPoint:
    """The last epoch of the centralised run in ``run_dir``, to continue with ``settings``
    (:func:`car_fl.results.resume.load_resume_point`, from ``checkpoints/last``), with its
    optimiser's state. Refused also when it trains nothing, or when its patience ran out
    at its last epoch."""
    if trains_nothing(settings):
        raise ValueError(
            f"resume={run_dir}: this run trains nothing (MIPS or kNN on the frozen encoder), "
            "so there is nothing to continue; run it again without resume="
        )
    check_run_dir(run_dir, "centralized")
    folder = run_dir / "checkpoints" / LAST
    if not (folder / WEIGHTS).is_file():
        raise FileNotFoundError(
            f"resume={run_dir}: checkpoints/{LAST} is missing: the run was stopped before its "
            "first epoch ended (or was made by a car-fl older than resume=); start it again"
        )
    point = load_resume_point(
        run_dir,
        settings,
        kind="centralized",
        steps=settings.train.epochs,
        steps_key="train.epochs",
        unit="epoch",
        may_change=MAY_CHANGE,
        fix="resume it with the same overrides (only train.epochs may change)",
        checkpoints=[folder],
    )
    done = point.done
    start = (
        RoundRow(round=0, epochs=0, metrics=point.initial, seconds=0.0) if point.initial else None
    )
    best = best_row(point.history, initial=start)
    stalled = best is not None and patience_spent(
        rows_since_best(point.history, best), settings.train.patience
    )
    if stalled and point.summary.complete:
        raise ValueError(
            f"resume={run_dir}: that run ended after epoch {done}, when train.patience="
            f"{settings.train.patience} epochs had not improved on validation: it finished, "
            "it was not interrupted; to train longer start a new run (a larger train.patience)"
        )
    optimizer = folder / optimizer_file(done)
    if not optimizer.is_file():
        raise FileNotFoundError(f"resume={run_dir}: {optimizer.name} is missing; start a new run")
    with safe_open(str(optimizer), framework="pt") as handle:
        if (handle.metadata() or {}).get("epoch") != str(done):
            raise ValueError(f"resume={run_dir}: {optimizer.name} is not epoch {done}'s")
    content = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8"))
    return EpochPoint(
        saved=point,
        optimizer=load_file(str(optimizer)),
        probe=content["summary"].get("probe", {}),
        finished=point.finished or stalled,
    )


def check_same_run(
    run_dir: Path,
    point: EpochPoint,
    *,
    data: dict[str, int],
    labels: LabelMap,
    extra: dict[str, Any],
) -> None:
    """Refuse to continue on other data than the run's: other split sizes, other labels, or
    another corpus or mixture layout (its checkpoints' ``extra``)."""
    saved = point.saved
    for what, before, now in (
        ("the data splits", saved.summary.data, data),
        ("the labels", saved.checkpoint.label_map.to_list(), labels.to_list()),
        ("the documents or experts", saved.checkpoint.extra, extra),
    ):
        if json.dumps(before, sort_keys=True) != json.dumps(now, sort_keys=True):
            raise ValueError(
                f"resume={run_dir}: {what} differ from that run's; point dataset.path (and "
                "dataset.documents_path) at the files it was trained on"
            )

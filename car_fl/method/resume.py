"""Continuing an interrupted centralised run: ``car-fl train resume=<its run directory>``.

After every epoch a run keeps ``checkpoints/last`` (the trainable tensors, and beside them the
optimiser's state in ``optimizer.safetensors``) and rewrites ``metrics.json`` (``complete:
false`` until it ends). A resumed run loads both and goes on from the next epoch: each epoch's
data order and dropout depend only on the seed and the epoch
(:func:`car_fl.method.train.epoch_seed`), so it ends where an uninterrupted run would. The
federation's counterpart is :mod:`car_fl.server.resume` (its clients start every round with a
new optimiser).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from car_fl.common.io import atomic_write
from car_fl.results.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from car_fl.results.rows import METRICS_JSON, MetricsFile, RoundRow
from car_fl.settings.compose import settings_from_yaml
from car_fl.settings.flower import fingerprint
from car_fl.settings.schema import Settings, trains_nothing

#: ``checkpoints/last``: the state after the last epoch, what a resume continues from.
LAST = "last"
#: The optimiser's state, beside ``checkpoints/last``'s weights.
OPTIMIZER = "optimizer.safetensors"


@dataclass
class EpochPoint:
    """Where a resumed run continues: after ``epoch``, with what the run had written."""

    epoch: int
    state: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    history: list[RoundRow]
    initial: dict[str, float]
    #: Seconds the run had taken before it was interrupted (its ``total_seconds``).
    seconds: float
    #: The saved run's split sizes, to be found again (``data`` in its summary).
    data: dict[str, int]
    #: The probe's curve (``train.probe_epochs``): the probe is not run again.
    probe: dict[str, Any] = field(default_factory=dict)


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
    """``checkpoints/last``: the epoch's checkpoint and the optimiser's state (atomically each;
    the epoch is in both, so a run killed between the two writes is refused, not mixed)."""
    tensors = optimizer_tensors(optimizer)
    header = {"epoch": str(checkpoint.round)}
    data = save(tensors, metadata=header)
    atomic_write(folder / OPTIMIZER, lambda tmp: _write_bytes(tmp, data))
    save_checkpoint(folder, checkpoint)


def _write_bytes(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def check_run_dir(run_dir: Path) -> None:
    """``FileNotFoundError`` unless ``run_dir`` holds what a resume reads (checked before any
    other work: a mistyped folder fails in seconds)."""
    for path in (
        run_dir / "config.yaml",
        run_dir / METRICS_JSON,
        run_dir / "checkpoints" / LAST / OPTIMIZER,
    ):
        if not path.is_file():
            raise FileNotFoundError(
                f"resume={run_dir}: {path.relative_to(run_dir)} is missing; resume= takes the "
                "folder of a centralised run that trained at least one epoch"
            )


def load_epoch_point(run_dir: Path, settings: Settings) -> EpochPoint:
    """The last epoch of the run in ``run_dir``, to continue with ``settings``.

    Refused (``ValueError``/``FileNotFoundError``, saying what to do) when the folder is not a
    centralised run, its configuration differs (only ``train.epochs`` may change, raised above
    the epochs done), it trains nothing, or ``train.patience`` had ended it.
    """
    if trains_nothing(settings):
        raise ValueError(
            f"resume={run_dir}: this run trains nothing (MIPS or kNN on the frozen encoder), "
            "so there is nothing to continue; run it again without resume="
        )
    check_run_dir(run_dir)
    saved_config = run_dir / "config.yaml"
    saved = settings_from_yaml(saved_config.read_text(encoding="utf-8"))
    same_epochs = replace(saved, train=replace(saved.train, epochs=settings.train.epochs))
    if fingerprint(same_epochs) != fingerprint(settings):
        raise ValueError(
            f"resume={run_dir}: that run was made with another configuration (see its "
            "config.yaml); resume it with the same overrides (only train.epochs may change)"
        )
    metrics = MetricsFile.read(run_dir)
    content = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8"))
    if metrics.summary.kind != "centralized":
        raise ValueError(
            f"resume={run_dir}: that is a {metrics.summary.kind} run; car-fl train resumes "
            "centralised runs (resume a federation with car-fl run / flwr run .)"
        )
    stopped = metrics.summary.stopped_early
    if stopped is not None:
        raise ValueError(
            f"resume={run_dir}: that run ended after epoch {stopped}, when train.patience="
            f"{settings.train.patience} epochs had not improved on validation: it finished, "
            "it was not interrupted; to train longer start a new run (a larger train.patience)"
        )
    folder = run_dir / "checkpoints" / LAST
    checkpoint = load_checkpoint(folder)
    with safe_open(str(folder / OPTIMIZER), framework="pt") as handle:
        optimizer_epoch = int((handle.metadata() or {}).get("epoch", -1))
    done = checkpoint.round
    if optimizer_epoch != done:
        raise ValueError(
            f"resume={run_dir}: checkpoints/last holds epoch {done} and its optimiser state "
            f"epoch {optimizer_epoch} (the run was stopped while writing them); start a new run"
        )
    if done >= settings.train.epochs:
        raise ValueError(
            f"resume={run_dir}: the run already has {done} epochs; raise train.epochs above it"
        )
    return EpochPoint(
        epoch=done,
        state=checkpoint.state,
        optimizer=load_file(str(folder / OPTIMIZER)),
        history=[row for row in metrics.history if row.round <= done],
        initial=metrics.summary.initial or {},
        seconds=metrics.summary.total_seconds,
        data=metrics.summary.data,
        probe=content["summary"].get("probe", {}),
    )


def check_same_data(run_dir: Path, saved: dict[str, int], now: dict[str, int]) -> None:
    """Refuse to continue on splits of other sizes than the run's (another data file)."""
    if saved != now:
        raise ValueError(
            f"resume={run_dir}: the data splits differ from that run's ({now} against {saved}); "
            "point dataset.path at the file it was trained on"
        )

"""Checkpoints: adapter + head weights (safetensors), label map, resolved config, round, metrics.

A checkpoint folder holds ``weights.safetensors`` (only trainable tensors: never the encoder)
and ``meta.json`` (label map, mode, round, metrics, privacy spent, resolved config as YAML), so
that a run can be understood and reused from the folder alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from car_fl.config import Settings, settings_from_yaml, settings_to_yaml
from car_fl.data.labels import LabelMap
from car_fl.io import atomic_write, atomic_write_json

WEIGHTS = "weights.safetensors"
META = "meta.json"
FORMAT = "car-fl-checkpoint-v1"


@dataclass
class Checkpoint:
    """What a checkpoint folder holds."""

    state: dict[str, torch.Tensor]
    label_map: LabelMap
    settings: Settings
    round: int
    metrics: dict[str, Any] = field(default_factory=dict)
    epsilon: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(folder: str | Path, ckpt: Checkpoint) -> Path:
    """Write weights, then metadata (each atomically); returns the folder."""
    folder = Path(folder)
    state = {k: v.detach().cpu().contiguous() for k, v in ckpt.state.items()}
    atomic_write(
        folder / WEIGHTS, lambda tmp: save_file(state, str(tmp), metadata={"format": FORMAT})
    )
    meta = {
        "format": FORMAT,
        "round": ckpt.round,
        "mode": ckpt.settings.train.mode,
        "labels": ckpt.label_map.to_list(),
        "metrics": ckpt.metrics,
        "epsilon": ckpt.epsilon,
        "tensors": {k: list(v.shape) for k, v in state.items()},
        "extra": ckpt.extra,
        "config_yaml": settings_to_yaml(ckpt.settings),
    }
    atomic_write_json(folder / META, meta)
    return folder


def load_checkpoint(folder: str | Path) -> Checkpoint:
    """Read a checkpoint folder (``FileNotFoundError`` if missing, ``ValueError`` if foreign)."""
    folder = Path(folder)
    for name in (WEIGHTS, META):
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"{folder} is not a car-fl checkpoint: {name} is missing (expected a folder "
                "written by a car-fl run, e.g. <run dir>/checkpoints/final)"
            )
    meta = json.loads((folder / META).read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder / META}: unknown checkpoint format {meta.get('format')!r}")
    return Checkpoint(
        state=load_file(str(folder / WEIGHTS)),
        label_map=LabelMap(tuple(meta["labels"])),
        settings=settings_from_yaml(meta["config_yaml"]),
        round=int(meta["round"]),
        metrics=meta.get("metrics", {}),
        epsilon=meta.get("epsilon"),
        extra=meta.get("extra", {}),
    )

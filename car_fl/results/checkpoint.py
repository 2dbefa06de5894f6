"""Checkpoints: adapter + head weights (safetensors), label map, resolved config, round, metrics.

``weights.safetensors`` holds only trainable tensors (never the encoder), with all the metadata
in its header, so one file explains the run; ``meta.json`` repeats the metadata for people.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from car_fl.common.io import atomic_write_bytes, atomic_write_json
from car_fl.data.labels import LabelMap
from car_fl.settings.compose import settings_from_yaml, settings_to_yaml
from car_fl.settings.schema import Settings

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
    """Write the checkpoint atomically (a crash leaves the previous one whole); the folder."""
    folder = Path(folder)
    state = {k: v.detach().cpu().contiguous() for k, v in ckpt.state.items()}
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
    header = {"format": FORMAT, "meta": json.dumps(meta)}
    # bytes, not save_file: safetensors' own temporary file would outlive a killed writer
    atomic_write_bytes(folder / WEIGHTS, save(state, metadata=header))
    atomic_write_json(folder / META, meta)
    return folder


def load_checkpoint(folder: str | Path) -> Checkpoint:
    """Read a checkpoint folder (``FileNotFoundError`` if missing, ``ValueError`` if foreign)."""
    folder = Path(folder)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(
            f"{folder} is not a car-fl checkpoint: {WEIGHTS} is missing (expected a folder "
            "written by a car-fl run, e.g. <run dir>/checkpoints/final)"
        )
    try:
        with safe_open(str(weights), framework="pt") as handle:
            header = handle.metadata() or {}
    except SafetensorError as err:  # cut short by a stop, or not safetensors at all
        raise ValueError(f"{weights}: not a readable safetensors file ({err})") from err
    if header.get("format") != FORMAT or "meta" not in header:
        raise ValueError(f"{weights}: not a car-fl checkpoint (format {header.get('format')!r})")
    meta = json.loads(header["meta"])
    return Checkpoint(
        state=load_file(str(weights)),
        label_map=LabelMap(tuple(meta["labels"])),
        settings=settings_from_yaml(meta["config_yaml"]),
        round=int(meta["round"]),
        metrics=meta.get("metrics", {}),
        epsilon=meta.get("epsilon"),
        extra=meta.get("extra", {}),
    )

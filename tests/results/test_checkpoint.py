"""Checkpoints: what a folder holds, foreign folders refused, and a crash mid-write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from car_fl.data.labels import LabelMap
from car_fl.results.run import META, WEIGHTS, Checkpoint, load_checkpoint, save_checkpoint
from car_fl.settings.compose import load_settings


def test_a_checkpoint_round_trips_state_labels_settings_and_metadata(tmp_path: Path) -> None:
    settings = load_settings(["seed=3", "head.pre_classifier_dim=8"])
    state = {"adapter.weight": torch.eye(3) * 2, "head.classifier.bias": torch.arange(4.0)}
    ckpt = Checkpoint(
        state=state,
        label_map=LabelMap(("ham", "spam")),
        settings=settings,
        round=7,
        metrics={"test_top1": 0.5},
        epsilon=2.5,
        extra={"note": "x"},
    )
    save_checkpoint(tmp_path / "c", ckpt)
    back = load_checkpoint(tmp_path / "c")
    assert list(back.state) == list(state)
    assert all(torch.equal(back.state[k], v) for k, v in state.items())
    assert back.label_map.names == ("ham", "spam")
    assert back.settings == settings
    assert (back.round, back.metrics, back.epsilon, back.extra) == (
        7,
        {"test_top1": 0.5},
        2.5,
        {"note": "x"},
    )
    meta = json.loads((tmp_path / "c" / META).read_text())
    assert meta["round"] == 7 and meta["labels"] == ["ham", "spam"]
    assert meta["tensors"] == {"adapter.weight": [3, 3], "head.classifier.bias": [4]}


def test_a_folder_without_a_car_fl_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a car-fl checkpoint"):
        load_checkpoint(tmp_path)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / WEIGHTS), metadata={"format": "other"})
    with pytest.raises(ValueError, match="not a car-fl checkpoint"):
        load_checkpoint(tmp_path)


WRITER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from car_fl.results.run import Checkpoint, save_checkpoint
    from car_fl.settings.compose import load_settings
    from car_fl.data.labels import LabelMap

    folder, ready = Path(sys.argv[1]), Path(sys.argv[2])
    settings = load_settings()
    labels = LabelMap(("a", "b"))
    k = 0
    while True:
        k += 1
        size = 64 if k == 1 else 4_000_000  # later checkpoints take a while to write
        state = {"w": torch.full((size,), float(k)), "b": torch.full((2,), float(k))}
        save_checkpoint(folder, Checkpoint(state=state, label_map=labels, settings=settings,
                                           round=k))
        ready.touch()
    """
)


@pytest.mark.slow
def test_killing_a_process_mid_write_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    folder, ready = tmp_path / "ckpt", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(ready)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the writer never finished its first checkpoint"
        time.sleep(1.3)  # somewhere inside a later, larger write
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    ckpt = load_checkpoint(folder)  # whole: tensors and metadata from the same write
    k = ckpt.round
    assert k >= 1
    assert ckpt.state["w"].eq(float(k)).all() and ckpt.state["b"].eq(float(k)).all()
    # Completed writes leave nothing behind: at most the one interrupted write's temporary file
    leftovers = sorted(p.name for p in folder.iterdir() if p.name not in (WEIGHTS, META))
    assert len(leftovers) <= 1, leftovers
    # ... and it does not stand in the way of the next checkpoint
    save_checkpoint(
        folder,
        Checkpoint(state=ckpt.state, label_map=ckpt.label_map, settings=ckpt.settings, round=k + 1),
    )
    assert load_checkpoint(folder).round == k + 1

"""Head-only epochs on cached features with one thread against torch's default, side by side.

    python scripts/bench_threads.py --json docs/results/threads/threads.json
    python scripts/bench_threads.py --busy 1 ...    # beside one busy process (load ~2 here)
    python scripts/bench_threads.py --smoke         # a few steps of each shape (a test)

For each head shape (features d, labels L, batch B) the product's ``train_epoch`` (classifier
mode, features cached) runs the same steps with ``torch.set_num_threads(1)`` and with the
default, alternating, ``--repeats`` times each; the median seconds per step, the CPU seconds,
and the 1-minute load average before and after are written beside each row. The shapes span
the presets: MiniLM and SmolLM2 on SMS (2 labels), arXiv categories, and document heads of
a few thousand rows at TinyLlama's width. ``car_fl.training.train.SMALL_STEP`` is read off
these rows. With ``--train-data`` (the SMS Spam Collection) it also runs the README's
``car-fl train model=minilm`` (features cached first) with the product's rule and with the
rule off, alternating, and writes each epoch's seconds (wall and CPU) beside the load.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from car_fl.model.features import LocalData  # noqa: E402
from car_fl.model.retriever import build_retriever  # noqa: E402
from car_fl.settings.compose import load_settings  # noqa: E402
from car_fl.training import train as thread_rule  # noqa: E402
from car_fl.training.train import (  # noqa: E402
    head_work,
    make_optimizer,
    train_epoch,
)

#: (name, features d, labels L, batch B)
SHAPES = [
    ("minilm-sms", 384, 2, 4),
    ("smollm2-sms", 576, 2, 4),
    ("smollm2-arxiv-categories", 576, 8, 4),
    ("minilm-sms-batch32", 384, 2, 32),
    ("minilm-documents-100", 384, 100, 4),
    ("smollm2-documents-500", 576, 500, 4),
    ("smollm2-documents-3k", 576, 3_146, 4),
    ("tinyllama-arxiv-categories", 2048, 8, 4),
    ("tinyllama-documents-8k", 2048, 8_143, 4),
    ("tinyllama-documents-8k-batch32", 2048, 8_143, 32),
]


def busy() -> None:
    while True:
        pass


def epoch_seconds(
    d: int, labels: int, batch: int, examples: int, threads: int
) -> tuple[float, float]:
    """Wall and CPU seconds per step of one head-only epoch with ``threads`` threads."""
    settings = load_settings(["model=local", "model.name_or_path=unused", "progress=false"])
    model = build_retriever(settings, labels, hidden_size=d)
    data = LocalData(
        features=torch.randn(examples, d, generator=torch.Generator().manual_seed(0)),
        labels=torch.randint(0, labels, (examples,), generator=torch.Generator().manual_seed(1)),
    )
    optimizer = make_optimizer(model, settings.train)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    thread_rule.SMALL_STEP = 0  # the product's rule off: the threads set here hold
    try:
        epoch = {"batch_size": batch, "seed": 0, "progress": False}
        train_epoch(model, data, optimizer, epoch=0, **epoch)  # type: ignore[arg-type]
        wall, cpu = time.perf_counter(), time.process_time()
        result = train_epoch(model, data, optimizer, epoch=1, **epoch)  # type: ignore[arg-type]
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        torch.set_num_threads(previous)
    return wall / result.steps, cpu / result.steps


TRAIN_CODE = """
import sys
import car_fl.training.train as rule
if sys.argv[1] == "off":
    rule.SMALL_STEP = 0
from car_fl.cli import main
sys.exit(main(["train", *sys.argv[2:]]))
"""


def train_epochs(data: Path, work: Path, rule: str, epochs: int) -> dict[str, Any]:
    """``car-fl train model=minilm`` on ``data`` (``rule``: on, or off); each epoch's seconds."""
    out = work / f"run-{rule}-{time.monotonic_ns()}"
    args = ["model=minilm", f"dataset.path={data}", f"train.epochs={epochs}"]
    args += [f"cache_dir={work / 'cache'}", f"output_dir={out}", "progress=false"]
    load_before = os.getloadavg()[0]
    cpu = os.times()
    subprocess.run([sys.executable, "-c", TRAIN_CODE, rule, *args], check=True, capture_output=True)
    after = os.times()
    history = json.loads((out / "metrics.json").read_text())["history"]
    return {
        "rule": rule,
        "epoch_seconds": [row["seconds"] for row in history],
        "test_top1": [row["test_top1"] for row in history],
        "process_cpu_seconds": after.children_user
        + after.children_system
        - cpu.children_user
        - cpu.children_system,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows here (and a .csv beside it)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400, help="steps per epoch")
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the bench")
    parser.add_argument("--smoke", action="store_true", help="a few steps of each shape")
    parser.add_argument("--train-data", type=Path, help="the SMS Spam Collection: car-fl train")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of each car-fl train run")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.steps = 1, 8
    default = torch.get_num_threads()
    hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.busy)]
    for hog in hogs:
        hog.start()
    rows: list[dict[str, Any]] = []
    try:
        time.sleep(1.0 if hogs else 0.0)
        for name, d, labels, batch in SHAPES:
            work = head_work(d * labels + labels, batch)
            steps = max(10, min(args.steps, int(2e9 / work)))  # large heads: fewer steps
            examples = steps * batch
            load_before = os.getloadavg()[0]
            timings: dict[int, list[tuple[float, float]]] = {1: [], default: []}
            for _ in range(args.repeats):
                for threads in timings:  # alternating: the same load for both
                    timings[threads].append(epoch_seconds(d, labels, batch, examples, threads))
            one = statistics.median(t[0] for t in timings[1])
            many = statistics.median(t[0] for t in timings[default])
            rows.append(
                {
                    "shape": name,
                    "d": d,
                    "labels": labels,
                    "batch": batch,
                    "work": work,
                    "steps": steps,
                    "threads_default": default,
                    "ms_per_step_1_thread": 1000 * one,
                    f"ms_per_step_{default}_threads": 1000 * many,
                    "cpu_ms_per_step_1_thread": 1000 * statistics.median(t[1] for t in timings[1]),
                    f"cpu_ms_per_step_{default}_threads": 1000
                    * statistics.median(t[1] for t in timings[default]),
                    "one_thread_speedup": many / one,
                    "load_before": load_before,
                    "load_after": os.getloadavg()[0],
                    "busy_processes": args.busy,
                }
            )
            print(
                f"{name:32s} work {work:>12,}  1 thread {1000 * one:7.3f} ms/step  "
                f"{default} threads {1000 * many:7.3f} ms/step  1-thread speed-up "
                f"{many / one:5.2f}x  load {load_before:.2f} -> {os.getloadavg()[0]:.2f}",
                flush=True,
            )
        trains: list[dict[str, Any]] = []
        if args.train_data:
            work = Path(tempfile.mkdtemp(prefix="bench-threads-"))
            train_epochs(args.train_data, work, "on", 1)  # the features, cached once
            for _ in range(args.repeats):
                for rule in ("on", "off"):
                    trains.append(train_epochs(args.train_data, work, rule, args.epochs))
                    row = trains[-1]
                    print(
                        f"car-fl train model=minilm, rule {rule:3s}: epochs "
                        + ", ".join(f"{t:.2f}" for t in row["epoch_seconds"])
                        + f" s, CPU {row['process_cpu_seconds']:.1f} s, load "
                        f"{row['load_before']:.2f} -> {row['load_after']:.2f}",
                        flush=True,
                    )
    finally:
        for hog in hogs:
            hog.terminate()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "command": " ".join(["python", *sys.argv]),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "capabilities": torch.backends.cpu.get_cpu_capability(),
        }
        content = {"meta": meta, "rows": rows, "car_fl_train": trains}
        args.json.write_text(json.dumps(content, indent=2) + "\n")
        with args.json.with_suffix(".csv").open("w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

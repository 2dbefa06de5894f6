"""One hostile client of three against each aggregation: final top-1 and whether the run completed.

    python scripts/attacks.py [--out DIR] [--rounds 4] [--attacks ...] [--strategies ...]

The tiny task (car_fl.testing.tiny: a random 2-layer Llama and 400 synthetic examples, built
offline), 3 clients, classifier mode; client 1 (partition 1) replaces its reply in every round
by the attack (car_fl/simulation/hostile.py). Federations run in this process
(car_fl/simulation/in_process.py: the real server and ClientApp handler, without Ray). Prints a
Markdown table and writes attacks.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from car_fl.settings.compose import load_settings  # noqa: E402
from car_fl.simulation.apps import import_app  # noqa: E402
from car_fl.simulation.hostile import ATTACKS, hostile_client  # noqa: E402
from car_fl.simulation.in_process import run_local  # noqa: E402
from car_fl.testing.tiny import build_llama, synthetic_examples, tiny_overrides, write_tsv  # noqa: E402

#: Column label → Hydra overrides of the aggregation.
STRATEGIES: dict[str, list[str]] = {
    "FedAvg": ["strategy=fedavg", "fl.norm_bound=off"],
    "FedAvg + norm bound, reject": ["strategy=fedavg", "fl.norm_bound=adaptive"],
    "FedAvg + norm bound, clip": [
        "strategy=fedavg",
        "fl.norm_bound=adaptive",
        "fl.norm_bound_action=clip",
    ],
    "FedAvg + norm bound, clip to median": [
        "strategy=fedavg",
        "fl.norm_bound=adaptive",
        "fl.norm_bound_action=clip",
        "fl.norm_bound_factor=1",
    ],
    "median": ["strategy=median"],
    "median + norm bound, reject": ["strategy=median", "fl.norm_bound=adaptive"],
    "trimmed mean": ["strategy=trimmed_mean"],
    "Krum": ["strategy=krum"],
}
#: The tiny task: 3 clients, 4 rounds × 2 local epochs.
TASK = ["fl.clients=3", "train.lr=0.01", "fl.local_epochs=2"]


def run_one(tiny: Path, out: Path, attack: str, label: str, rounds: int) -> dict[str, Any]:
    name = f"{attack}-{re.sub(r'[^a-z0-9]+', '-', label.lower()).strip('-')}"
    settings = load_settings(
        [
            *tiny_overrides(tiny / "llama", tiny / "synthetic.tsv", cache_dir=out / "cache"),
            f"output_dir={out / name}",
            f"fl.rounds={rounds}",
            *TASK,
            *STRATEGIES[label],
        ]
    )
    honest = import_app("client_app").train
    started = time.perf_counter()
    try:
        metrics = run_local(settings, client_train=hostile_client(honest, attack=attack))
    except Exception as err:  # the table reports a crashed run, it does not stop
        return {"attack": attack, "strategy": label, "completed": False, "error": repr(err)}
    final = metrics["history"][-1]
    return {
        "attack": attack,
        "strategy": label,
        "completed": bool(metrics["summary"]["complete"]),
        "top1": final["test_top1"],
        "rejected": sum(r["clients_rejected"] for r in metrics["history"]),
        "skipped_rounds": metrics["summary"]["skipped_rounds"],
        "seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/attacks"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # clients run one after another; tiny tensors
    out = args.out.resolve()
    tiny = out / "tiny"
    if not (tiny / "synthetic.tsv").is_file():
        build_llama(tiny / "llama")
        write_tsv(tiny / "synthetic.tsv", synthetic_examples(400))
    rows = []
    for attack in args.attacks:
        for label in args.strategies:
            row = run_one(tiny, out, attack, label, args.rounds)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    (out / "attacks.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    print(table(rows, args.attacks, args.strategies))
    return 0


def table(rows: list[dict[str, Any]], attacks: list[str], strategies: list[str]) -> str:
    """Attacks × strategies → final top-1 (replies rejected over the run), or 'crashed'."""
    cell = {(r["attack"], r["strategy"]): r for r in rows}
    lines = [
        "| hostile client sends | " + " | ".join(strategies) + " |",
        "|---|" + "---|" * len(strategies),
    ]
    for attack in attacks:
        values = []
        for label in strategies:
            row = cell[(attack, label)]
            if not row["completed"]:
                values.append("crashed")
            elif row["rejected"]:
                values.append(f"{row['top1']:.4f} ({row['rejected']} rejected)")
            else:
                values.append(f"{row['top1']:.4f}")
        lines.append(f"| {attack} | " + " | ".join(values) + " |")
    completed = sum(bool(r["completed"]) for r in rows)
    lines.append(f"\nruns completed: {completed} of {len(rows)}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

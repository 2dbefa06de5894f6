"""Per-round overhead of deployment (SuperLink + SuperNodes over gRPC) against simulation.

    python scripts/deploy_overhead.py [--rounds 4] [--clients 2]

Runs the same small configuration (a tiny random Llama, 400 synthetic examples, classifier
mode, features cached after round 1) twice, side by side: as an in-process Flower simulation
and on a local cluster (one SuperLink and N SuperNodes on 127.0.0.1, a new ClientApp process
per message). Reports, for rounds 2..R, the mean round wall time, the mean slowest client's
own training time (inside Node.train) and their difference, Flower's overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from car_fl.deploy.cluster import LocalCluster
from car_fl.simulation.flower import run_simulation
from car_fl.testing.tiny import build_llama, synthetic_examples, tiny_overrides, write_tsv

PROJECT = Path(__file__).resolve().parents[1]


def summarise(history: list[dict[str, float]]) -> dict[str, float]:
    later = history[1:]
    round_s = statistics.mean(r["seconds"] for r in later)
    train_s = statistics.mean(r["max_client_train_seconds"] for r in later)
    return {
        "round_seconds": round_s,
        "slowest_client_train_seconds": train_s,
        "overhead_seconds": round_s - train_s,
        "first_round_seconds": history[0]["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/deploy-overhead.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="car-fl-overhead-"))
    model = build_llama(work / "llama")
    data = write_tsv(work / "data.tsv", synthetic_examples(400))
    common = (
        " ".join(tiny_overrides(model, data))
        + f" fl.clients={args.clients} fl.rounds={args.rounds}"
    )

    sim = run_simulation(f"{common} cache_dir={work / 'sim-cache'} output_dir={work / 'sim'}")

    with LocalCluster(work / "cluster", connection="overhead") as cluster:
        cluster.start(args.clients, data=data, settle=5)
        result = cluster.run(PROJECT, f"{common} output_dir={work / 'deploy'}", timeout=1800)
    if not result.completed:
        raise SystemExit(f"deployment run did not complete: {result.status}")
    deploy = json.loads((work / "deploy" / "metrics.json").read_text())

    summary = {
        "simulation": summarise(sim["history"]),
        "deployment": summarise(deploy["history"]),
        "config": common,
    }
    print(f"{'':12s} {'round s':>9s} {'slowest client s':>17s} {'overhead s':>11s}")
    for name in ("simulation", "deployment"):
        r = summary[name]
        print(
            f"{name:12s} {r['round_seconds']:9.2f} {r['slowest_client_train_seconds']:17.2f} "
            f"{r['overhead_seconds']:11.2f}"
        )
    ratio = summary["deployment"]["round_seconds"] / summary["simulation"]["round_seconds"]
    print(f"deployment round / simulation round: {ratio:.1f}x (rounds 2..{args.rounds})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()

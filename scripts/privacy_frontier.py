"""The privacy–utility frontier on SMS spam: no DP, the paper's local DP, record-level DP-SGD.

    python scripts/privacy_frontier.py [--data PATH] [--out docs/results/privacy]

Runs Flower simulations (in this process) on the real SMS Spam Collection with the offline
MiniLM encoder in classifier mode, for 2 and 3 clients:

- ``FL`` (no DP), ``FL + DP (fixed)`` and ``FL + DP (adaptive)``: ``+experiment=sms_privacy``
  (the paper's FL settings and client-level DP defaults);
- ``FL + DP-SGD (record)`` at ε ∈ {1, 3, 8}, δ = 1e-5: ``+experiment=sms_privacy_record``
  (tuned on the validation split by ``scripts/tune_dpsgd.py``);
- with ``--adapter``, one adapter + classifier point of record-level DP-SGD.

Writes ``frontier.csv``, ``frontier.md`` (top-1, macro-F1, ε per run; the final global model
on the test split) and ``frontier.png`` (top-1 against ε, one line per mode and client count)
to ``--out``; each run's own directory (config, metrics, per-client σ, q, steps and ε in
``metrics.json``) under ``--runs``.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from car_fl.common.progress import setup_logging
from car_fl.settings.compose import load_settings
from car_fl.settings.schema import DPMode
from car_fl.simulation.flower import run_simulation

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/sms_spam/SMSSpamCollection.tsv"
MODES = {
    "none": "FL (no DP)",
    "fixed": "FL + DP (fixed, paper)",
    "adaptive": "FL + DP (adaptive, paper)",
    "record": "FL + DP-SGD (record)",
}


def jobs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(name, overrides) of every run of the frontier."""
    out = []
    for clients in args.clients:
        m = f"fl.clients={clients}"
        for dp in ("none", "fixed", "adaptive"):
            out.append((f"m{clients}-{dp}", ["+experiment=sms_privacy", f"dp={dp}", m]))
        for eps in args.epsilons:
            overrides = ["+experiment=sms_privacy_record", f"dp.target_epsilon={eps}", m]
            out.append((f"m{clients}-record-eps{eps:g}", overrides))
    if args.adapter:
        out.append(
            (
                "m2-adapter-record-eps3",
                [
                    "+experiment=sms_privacy_record",
                    "dp.target_epsilon=3",
                    "fl.clients=2",
                    "mode=adapter",
                    *args.adapter_overrides,
                ],
            )
        )
    return out


def warm_feature_cache(args: argparse.Namespace) -> None:
    """The whole training split's features in the node cache: one encoder pass.

    The cache is per text (:class:`car_fl.model.feature_cache.FeatureCache`), so every client's
    shard, whatever the client count, is then answered from it without the encoder.
    """
    from car_fl.data.splits import load_splits
    from car_fl.model.features import prepare_for
    from car_fl.model.retriever import build_retriever

    base = ["+experiment=sms_privacy", f"dataset.path={args.data.resolve()}", "progress=false"]
    settings = load_settings([*base, *args.extra])
    splits = load_splits(settings.dataset, seed=settings.seed)
    holder: dict[str, Any] = {}

    def get_model() -> Any:
        if "m" not in holder:
            holder["m"] = build_retriever(settings, len(splits.label_map))
        return holder["m"]

    texts, labels = splits.train["text"], splits.train["label"]
    prepare_for(settings, texts, labels, get_model=get_model, desc="train features")


def run_one(name: str, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    run_dir = (args.runs / name).resolve()
    settings = load_settings(
        [
            *overrides,
            f"dataset.path={args.data.resolve()}",
            "progress=false",
            f"output_dir={run_dir}",
            *args.extra,
        ]
    )
    tick = time.perf_counter()
    metrics = run_simulation(settings=settings)
    summary = metrics["summary"]
    final = summary["final"]
    return {
        "run": name,
        "mode": settings.dp.mode,
        "train_mode": settings.train.mode,
        "clients": settings.fl.clients,
        "target_epsilon": settings.dp.target_epsilon if settings.dp.mode is DPMode.RECORD else "",
        "top1": final["test_top1"],
        "macro_f1": final["test_macro_f1"],
        "epsilon": summary["epsilon"] if settings.dp.mode != "none" else math.inf,
        "delta": settings.dp.delta,
        "dp_clients": json.dumps(summary.get("dp_clients", {})),
        "seconds": time.perf_counter() - tick,
        "overrides": " ".join(overrides),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| clients | mode | train mode | ε (δ = 1e-5) | test top-1 (%) | macro-F1 | Δ top-1 vs FL "
        "(points) | Δ macro-F1 vs FL | wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    reference = {
        r["clients"]: r for r in rows if r["mode"] == "none" and r["train_mode"] == "classifier"
    }
    for r in rows:
        # the adapter point runs on other data (see --adapter-overrides): no difference shown
        ref = reference.get(r["clients"]) if r["train_mode"] == "classifier" else None
        eps = "∞ (no DP)" if math.isinf(r["epsilon"]) else f"{r['epsilon']:.4g}"
        d_top1 = f"{100 * (r['top1'] - ref['top1']):+.2f}" if ref and ref is not r else "–"
        d_f1 = f"{r['macro_f1'] - ref['macro_f1']:+.4f}" if ref and ref is not r else "–"
        lines.append(
            f"| {r['clients']} | {MODES[r['mode']]} | {r['train_mode']} | {eps} | "
            f"{100 * r['top1']:.2f} | {r['macro_f1']:.4f} | {d_top1} | {d_f1} | "
            f"{r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    finite = [r["epsilon"] for r in rows if not math.isinf(r["epsilon"])]
    right = max(finite, default=10.0) * 3
    markers = {2: "o", 3: "s"}
    for clients in sorted({r["clients"] for r in rows}):
        group = [r for r in rows if r["clients"] == clients and r["train_mode"] == "classifier"]
        for mode, label in MODES.items():
            points = sorted((r["epsilon"], r["top1"]) for r in group if r["mode"] == mode)
            if not points:
                continue
            name = f"{label}, {clients} clients"
            if mode == "none":
                ax.axhline(100 * points[0][1], linestyle="--", linewidth=1, label=name)
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, [100 * y for y in ys], marker=markers.get(clients, "^"), label=name)
    for r in rows:
        if r["train_mode"] != "classifier":
            ax.plot(
                [r["epsilon"]],
                [100 * r["top1"]],
                marker="*",
                markersize=12,
                linestyle="",
                label=f"DP-SGD adapter + classifier, {r['clients']} clients",
            )
    ax.set_xscale("log")
    ax.set_xlim(0.5, right)
    ax.set(
        xlabel="ε per client (δ = 1e-5, log scale)",
        ylabel="test top-1 accuracy (%)",
        title="SMS spam, MiniLM: privacy–utility frontier",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("docs/results/privacy"))
    parser.add_argument("--runs", type=Path, default=Path("runs/privacy-frontier"))
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    parser.add_argument("--adapter", action="store_true", help="add one adapter-mode point")
    parser.add_argument(
        "--adapter-overrides",
        nargs="*",
        default=["fl.rounds=1", "fl.local_epochs=1"],
        help="overrides of the adapter-mode point (each step runs the encoder per example)",
    )
    parser.add_argument("--only", nargs="*", default=None, help="run only these job names")
    parser.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for all")
    parser.add_argument(
        "--merge", type=Path, nargs="*", default=[], help="frontier.csv files of other runs to add"
    )
    args = parser.parse_args()
    setup_logging()
    logging.getLogger("flwr").propagate = False
    args.out.mkdir(parents=True, exist_ok=True)
    warm_feature_cache(args)
    rows_file = args.out / "frontier.csv"
    done: dict[str, dict[str, Any]] = {}
    # keep earlier rows (--only re-runs or adds some jobs) and those of --merge
    for source in [rows_file, *args.merge]:
        if not source.is_file():
            continue
        for row in csv.DictReader(source.open()):
            for key in ("top1", "macro_f1", "epsilon", "delta", "seconds"):
                row[key] = float(row[key])
            row["clients"] = int(row["clients"])
            done[row["run"]] = row
    for name, overrides in jobs(args):
        if args.only is not None and name not in args.only:
            continue
        row = run_one(name, overrides, args)
        done[name] = row
        print(
            f"{name}: top-1 {100 * row['top1']:.2f} % macro-F1 {row['macro_f1']:.4f} "
            f"ε {row['epsilon']:.4g} ({row['seconds']:.0f} s)",
            flush=True,
        )
        write_outputs(done, args, rows_file)
    write_outputs(done, args, rows_file)
    print((args.out / "frontier.md").read_text() if done else "no runs")


def write_outputs(done: dict[str, dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    """frontier.csv, frontier.md and frontier.png from every row so far."""
    if not done:
        return
    order = [n for n, _ in jobs(args)]
    rows = sorted(done.values(), key=lambda r: order.index(r["run"]) if r["run"] in order else 99)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "frontier.md").write_text(markdown(rows))
    plot(rows, args.out / "frontier.png")


if __name__ == "__main__":
    main()

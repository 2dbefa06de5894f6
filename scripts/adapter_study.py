"""Does the soft-embedding adapter earn its cost? Adapter kinds against CaR, every seed kept.

    python scripts/adapter_study.py run --model minilm --task categories --out runs/adapter-study
    python scripts/adapter_study.py run --model smollm2 --task categories --plan private --jobs 2
    python scripts/adapter_study.py report --out runs/adapter-study

Every row is a real run of the product: ``car-fl train`` (centralised, and ``dp=record``, which
runs as a one-node federation) or, for federated rows, the real ServerApp and ClientApp in one
process (:func:`car_fl.simulation.in_process.run_local`, ``--plan federated``); the overrides of
each run are in its ``config.yaml`` and in ``runs.json`` beside it. Selection is on validation
only: each run keeps the epoch (or round) with the best validation score, adapter runs start from
the linear probe's selected head (their epoch 0 is CaR's head), and the report ranks the kinds by
their mean validation score; test is printed beside it and never chooses. ``--seeds`` changes the
split (categories), the initialisation and the data order; every seed is reported, with the mean
and the spread (sample standard deviation), wall and CPU seconds, the load average and the bytes
one reply of the run's trained state takes on the wire (Flower's ``ArrayRecord``, as a node
sends it; federated rows also give the bytes the server measured from each reply).

Plans (``--plan``): ``grid``: CaR, the full adapter, low-rank r ∈ {4, 16, 64} and the diagonal
one, each with and without the identity anchor; ``federated``: CaR, full and low-rank r = 16 with
2 clients; ``private``: the same under record-level DP-SGD at ε 3 (centralised) and under the
paper's local DP (adaptive clipping, 2 clients). Learning rates are fixed in advance, not tuned
on test: the head's 10⁻³, the full adapter's 10⁻⁴ (earlier sessions' choice on validation,
docs/experiments.md), 10⁻³ for the low-rank and diagonal ones (LoRA's usual ten times the full
rate). Tasks: ``categories`` (arXiv's primary category, the 81 with ≥ 50 papers, top-1) and
``sms`` (the SMS Spam Collection, top-1) and ``documents`` (arXiv papers as documents,
abstract sentences as queries: R@10; the corpus from ``scripts/arxiv_corpus.py --sample``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"

MODELS = {"smollm2": ["model=smollm2"], "minilm": ["model=minilm"], "gemma3": ["model=gemma3"]}
#: λ of the identity anchor in every anchored row (L2-SP's usual order; not tuned).
ANCHOR = 0.01
HEAD = ["train.lr=0.001", "train.batch_size=32"]
ADAPTER = ["approach=adapter_car", "train.probe_epochs=40"]
KINDS: dict[str, list[str]] = {
    "full": ["adapter.kind=full", "train.adapter_lr=1e-4"],
    **{
        f"lowrank{r}": ["adapter.kind=lowrank", f"adapter.rank={r}", "train.adapter_lr=1e-3"]
        for r in (4, 16, 64)
    },
    "diagonal": ["adapter.kind=diagonal", "train.adapter_lr=1e-3"],
}


def task_overrides(task: str, data: Path) -> tuple[list[str], str]:
    """The run's dataset overrides and the metric that selects and is reported."""
    if task == "categories":
        return [
            "dataset=arxiv",
            f"dataset.path={data}",
            "dataset.min_examples_per_label=50",
            "model.max_length=64",
        ], "top1"
    if task == "sms":
        return ["dataset=sms_spam", f"dataset.path={data}"], "top1"
    if task == "documents":
        return [
            "dataset=corpus",
            f"dataset.path={data / 'queries.jsonl'}",
            f"dataset.documents_path={data / 'documents.jsonl'}",
            "dataset.new_fraction=0",
            "model.max_length=64",
        ], "recall@10"
    raise SystemExit(f"--task {task!r}: choose categories, sms or documents")


@dataclass
class Job:
    """One run: its name, how it runs and its overrides."""

    name: str
    seed: int
    runner: str  # "train" (car-fl train) or "federated" (run_local, 2 clients)
    overrides: list[str]
    folder: str = ""
    result: dict[str, Any] = field(default_factory=dict)


def plan(
    name: str, epochs: int, patience: int, only: list[str] | None
) -> list[tuple[str, str, list[str]]]:
    """(row name, runner, overrides) of a plan."""
    car = ["approach=car", f"train.epochs={epochs * 4}", f"train.patience={patience}"]
    adapter = [*ADAPTER, f"train.epochs={epochs}", f"train.patience={patience}"]
    rows: list[tuple[str, str, list[str]]] = []
    if name == "grid":
        rows.append(("car", "train", car))
        for kind, settings in KINDS.items():
            rows.append((kind, "train", [*adapter, *settings]))
            rows.append(
                (f"{kind}+anchor", "train", [*adapter, *settings, f"adapter.anchor={ANCHOR}"])
            )
    elif name == "federated":
        fed = ["fl.clients=2", "fl.local_epochs=1", f"train.patience={patience}"]
        rows.append(("fl-car", "federated", ["approach=car", f"fl.rounds={epochs}", *fed]))
        probe = [  # the head probed for half the rounds first, as a centralised run probes
            "approach=adapter_car",
            f"fl.probe_rounds={max(epochs // 2, 1)}",
            f"fl.rounds={epochs + max(epochs // 2, 1)}",
            *fed,
        ]
        for kind in ("full", "lowrank16"):
            rows.append((f"fl-{kind}", "federated", [*probe, *KINDS[kind]]))
    elif name == "private":
        record = [
            "dp=record",
            "dp.target_epsilon=3",
            "dp.delta=1e-5",
            "dp.sample_rate=0.02",
            "dp.clip=1",
            "model.normalize=l2",
            "train.optimizer=sgd",
            "train.lr=8",
            f"train.epochs={epochs}",
        ]
        rows.append(("dpsgd-car", "train", ["approach=car", *record]))
        for kind in ("full", "lowrank16"):
            lr = "0.1" if kind == "full" else "1"
            settings = [*KINDS[kind][:-1], f"train.adapter_lr={lr}"]
            rows.append((f"dpsgd-{kind}", "train", ["approach=adapter_car", *settings, *record]))
        local = ["dp=adaptive", "fl.clients=2", f"fl.rounds={epochs}", "fl.local_epochs=1"]
        rows.append(("ldp-car", "federated", ["approach=car", *local]))
        for kind in ("full", "lowrank16"):
            rows.append(
                (f"ldp-{kind}", "federated", ["approach=adapter_car", *KINDS[kind], *local])
            )
    else:
        raise SystemExit(f"--plan {name!r}: choose grid, federated or private")
    return [row for row in rows if only is None or row[0] in only]


# ------------------------------------------------------------------------------------ running


def merged(*groups: list[str]) -> list[str]:
    """Overrides in order, a later value of a key replacing an earlier one (Hydra refuses a
    key given twice)."""
    out: dict[str, str] = {}
    for group in groups:
        for item in group:
            out[item.split("=", 1)[0]] = item
    return list(out.values())


def launch(job: Job, python: str) -> subprocess.Popen[bytes]:
    out = Path(job.folder)
    out.mkdir(parents=True, exist_ok=True)
    if job.runner == "train":
        command = [python, "-m", "car_fl.cli", "train", *job.overrides, f"output_dir={out}"]
    else:
        command = [python, str(Path(__file__).resolve()), "federate", str(out), *job.overrides]
    (out / "command.txt").write_text(shlex.join(command) + "\n", encoding="utf-8")
    log = (out / "log.txt").open("wb")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def run_jobs(
    jobs: list[Job],
    parallel: int,
    python: str,
    timeout: float | None,
    stop_after: float | None = None,
) -> None:
    """Run ``jobs`` ``parallel`` at a time; each one's wall and CPU seconds from its own
    rusage (``os.wait4``), the load average at its start and end. A run past ``timeout``
    seconds, or still running ``stop_after`` seconds after the first started, is stopped
    (SIGTERM) and marked cut: its rows so far (metrics.json is written after every epoch) still
    give the epoch validation selected among those it ran; after ``stop_after`` no run starts."""
    from tqdm import tqdm

    begun = time.monotonic()
    pending = list(jobs)
    running: dict[int, tuple[Job, subprocess.Popen[bytes], float, float]] = {}
    with tqdm(total=len(jobs), desc="runs", unit="run") as bar:
        while pending or running:
            while pending and len(running) < parallel:
                job = pending.pop(0)
                process = launch(job, python)
                running[process.pid] = (job, process, time.monotonic(), os.getloadavg()[0])
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                now = time.monotonic()
                over = stop_after is not None and now - begun > stop_after
                if over and pending:
                    bar.write(f"--stop-after {stop_after:g} s: {len(pending)} runs not started")
                    pending.clear()
                for job, process, started, _ in running.values():
                    late = timeout is not None and now - started > timeout
                    if (late or over) and not job.result:
                        job.result = {"cut": True}
                        process.terminate()
                time.sleep(0.5)
                continue
            if pid not in running:
                continue
            job, process, started, load = running.pop(pid)
            process.returncode = os.waitstatus_to_exitcode(status)
            cut = bool(job.result.get("cut"))
            job.result = {
                "exit": 0 if cut else process.returncode,
                "cut": cut,
                "wall_s": time.monotonic() - started,
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "load": [load, os.getloadavg()[0]],
                **read_run(Path(job.folder)),
            }
            if cut and not job.result.get("best"):
                job.result["exit"] = process.returncode
            path = Path(job.folder) / "study.json"
            path.write_text(json.dumps(job.result, indent=1), encoding="utf-8")
            bar.update(1)
            note = " (cut at the time limit)" if cut else ""
            if job.result["exit"] != 0:
                note = f" FAILED (exit {process.returncode}), see {job.folder}/log.txt"
            bar.write(f"{job.name} seed {job.seed}: {job.result.get('summary_line', '')}{note}")


def read_run(folder: Path) -> dict[str, Any]:
    """The selected row's validation and test metrics, the start's, ε, and the bytes."""
    path = folder / "metrics.json"
    if not path.is_file():
        return {}
    metrics = json.loads(path.read_text(encoding="utf-8"))
    summary = metrics["summary"]
    best, initial = summary.get("best") or {}, summary.get("initial") or {}
    received = [  # what the server measured of each reply, per client that answered
        row["bytes_received"] / row["clients_ok"]
        for row in metrics["history"]
        if row.get("bytes_received") and row.get("clients_ok")
    ]
    out: dict[str, Any] = {
        "best": {k: v for k, v in best.items() if isinstance(v, int | float)},
        "initial": {k: v for k, v in initial.items() if isinstance(v, int | float)},
        "rounds_run": len(metrics["history"]),
        "epsilon": summary.get("epsilon", best.get("epsilon")),
        "reply_bytes_measured": round(max(received)) if received else None,
        "reply_bytes": reply_bytes(folder / "checkpoints" / "best"),
    }
    out["summary_line"] = f"selected {best.get('round')}, val {best.get('val_top1', 0):.4f}"
    return out


def reply_bytes(checkpoint: Path) -> int | None:
    """The bytes of one reply carrying this trained state: each tensor encoded as a node
    encodes it (:func:`car_fl.protocol.messages.to_record`), counted by the server's own
    measure (:func:`car_fl.protocol.messages.payload_bytes`)."""
    if not (checkpoint / "weights.safetensors").is_file():
        return None
    from car_fl.protocol.messages import payload_bytes, to_record
    from car_fl.results.run import load_checkpoint

    return payload_bytes(to_record(load_checkpoint(checkpoint).state))


def federate(folder: str, overrides: list[str]) -> int:
    """One federated run in this process: the real ServerApp and ClientApp, no Ray."""
    from car_fl.settings.compose import load_settings
    from car_fl.simulation.in_process import run_local

    settings = load_settings([*overrides, f"output_dir={folder}"])
    result = run_local(settings)
    best = result["summary"].get("best") or {}
    print(f"federated run done: selected round {best.get('round')}; results: {folder}")
    return 0


# ------------------------------------------------------------------------------------ report


def spread(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values) if values else math.nan
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def _ok(result: dict[str, Any]) -> bool:
    """A run that ended cleanly with a selected state (a cut run keeps its selection)."""
    return result.get("exit") == 0 and bool(result.get("best"))


def report(out: Path) -> str:
    """Every study.json under ``out`` as one table per (model, task, plan): the rows ranked by
    mean validation score, each seed's test score, the spread, times and bytes."""
    runs = sorted(out.glob("*/*/*/seed*/study.json"))
    groups: dict[tuple[str, str, str], dict[str, list[dict[str, Any]]]] = {}
    for path in runs:
        seed_dir = path.parent
        row, plan_name, study = (
            seed_dir.parent.name,
            seed_dir.parent.parent.name,
            seed_dir.parent.parent.parent.name,
        )
        result = json.loads(path.read_text(encoding="utf-8"))
        result["seed"] = int(seed_dir.name.removeprefix("seed"))
        groups.setdefault((study, plan_name, ""), {}).setdefault(row, []).append(result)
    lines: list[str] = []
    table: list[dict[str, Any]] = []
    for (study, plan_name, _), rows in sorted(groups.items()):
        metric = "recall@10" if "documents" in study else "top1"
        reference = rows.get("car") or rows.get("fl-car") or rows.get("dpsgd-car")
        ref_test = spread(
            [r["best"].get(f"test_{metric}", math.nan) for r in reference or [] if _ok(r)]
        )
        lines += [f"### {study}, plan {plan_name} (metric: {metric}, ×100)", ""]
        columns = [
            "row",
            "val mean ± sd",
            "test mean ± sd",
            "test per seed",
            "Δ test vs CaR",
            "selected / run epochs per seed",
            "ε",
            "reply bytes",
            "wall s",
            "CPU s",
            "load",
        ]
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        ranked = sorted(
            rows.items(),
            key=lambda item: (
                -spread([r["best"].get(f"val_{metric}", math.nan) for r in item[1] if _ok(r)])[0]
            ),
        )
        for name, results in ranked:
            ok = [r for r in results if _ok(r)]  # the rows' figures, rank and Δ: these alone
            early = sum(bool(r.get("cut")) and not r.get("best") for r in results)
            failed = len(results) - len(ok) - early
            cut = sum(bool(r.get("cut")) for r in ok)
            val = spread([100 * r["best"][f"val_{metric}"] for r in ok])
            test = spread([100 * r["best"][f"test_{metric}"] for r in ok])
            per_seed = ", ".join(
                f"{100 * r['best'][f'test_{metric}']:.2f}"
                for r in sorted(ok, key=lambda r: r["seed"])
            )
            selected = ", ".join(
                f"{r['best'].get('round')}/{r.get('rounds_run')}"
                for r in sorted(ok, key=lambda r: r["seed"])
            )
            delta = test[0] - 100 * ref_test[0] if reference else math.nan
            eps = [r["epsilon"] for r in ok if r.get("epsilon")]
            size = [r.get("reply_bytes_measured") or r.get("reply_bytes") for r in ok]
            wall = statistics.fmean(r["wall_s"] for r in ok) if ok else math.nan
            cpu = statistics.fmean(r["cpu_s"] for r in ok) if ok else math.nan
            load = (
                f"{min(r['load'][0] for r in ok):.1f}–{max(r['load'][1] for r in ok):.1f}"
                if ok
                else "–"
            )
            lines.append(
                f"| {name}{f' ({failed} failed)' if failed else ''}"
                f"{f' ({cut} cut)' if cut else ''}"
                f"{f' ({early} cut before an epoch)' if early else ''} | "
                f"{val[0]:.2f} ± {val[1]:.2f} | "
                f"{test[0]:.2f} ± {test[1]:.2f} | {per_seed} | {delta:+.2f} | {selected} | "
                f"{f'{max(eps):.2f}' if eps else '–'} | "
                f"{max((s for s in size if s), default=0):,} | {wall:.0f} | {cpu:.0f} | {load} |"
            )
            table.append(
                {
                    "study": study,
                    "plan": plan_name,
                    "row": name,
                    "metric": metric,
                    "seeds": [r["seed"] for r in ok],
                    "failed": failed,
                    "cut": cut,
                    "cut_before_an_epoch": early,
                    "epochs_run": [r.get("rounds_run") for r in ok],
                    "val_mean": val[0],
                    "val_sd": val[1],
                    "test_mean": test[0],
                    "test_sd": test[1],
                    "test_per_seed": [100 * r["best"][f"test_{metric}"] for r in ok],
                    "delta_test_vs_car": delta,
                    "selected": [r["best"].get("round") for r in ok],
                    "epsilon": max(eps) if eps else None,
                    "reply_bytes": max((s for s in size if s), default=None),
                    "wall_s": wall,
                    "cpu_s": cpu,
                }
            )
        lines.append("")
    (out / "results.json").write_text(json.dumps(table, indent=1), encoding="utf-8")
    text = "\n".join(lines)
    (out / "results.md").write_text(text + "\n", encoding="utf-8")
    plot(out, table)
    return text


def plot(out: Path, table: list[dict[str, Any]]) -> None:
    """One panel per study and plan: each row's test score per seed (dots) and mean (bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(t["study"], t["plan"]) for t in table})
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False)
    for ax, (study, plan_name) in zip(axes[:, 0], panels, strict=True):
        rows = [t for t in table if (t["study"], t["plan"]) == (study, plan_name)]
        for i, row in enumerate(rows):
            ax.bar(i, row["test_mean"], color="#9ecae1")
            ax.scatter(
                [i] * len(row["test_per_seed"]),
                row["test_per_seed"],
                color="#08519c",
                zorder=3,
                s=12,
            )
        car = next((r for r in rows if r["row"].endswith("car")), None)
        if car:
            ax.axhline(car["test_mean"], color="#e6550d", lw=1, label="CaR (mean)")
            ax.legend(loc="lower right")
        low = min(min(r["test_per_seed"] or [0]) for r in rows)
        high = max(max(r["test_per_seed"] or [1]) for r in rows)
        ax.set_ylim(max(0.0, low - 3), high + 2)
        ax.set_xticks(range(len(rows)), [r["row"] for r in rows], rotation=30, ha="right")
        ax.set_ylabel(f"test {rows[0]['metric']} (%)")
        ax.set_title(
            f"{study}, {plan_name}: test per seed (dots), mean (bars); ranked by validation"
        )
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a plan's rows for every seed")
    run.add_argument(
        "--model", default="minilm", help=f"one of {', '.join(MODELS)}, or a model folder"
    )
    run.add_argument("--task", default="categories", choices=["categories", "sms", "documents"])
    run.add_argument(
        "--data", type=Path, help="arxiv_dev.jsonl (categories) or the corpus folder (documents)"
    )
    run.add_argument("--plan", default="grid", choices=["grid", "federated", "private"])
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    run.add_argument("--epochs", type=int, default=10, help="the adapter's ceiling (CaR: 4×)")
    run.add_argument("--patience", type=int, default=3)
    run.add_argument("--jobs", type=int, default=2, help="runs at a time")
    run.add_argument("--only", nargs="+", help="these rows of the plan only")
    run.add_argument("--set", nargs="+", default=[], help="more overrides for every run")
    run.add_argument("--out", type=Path, default=ROOT / "runs" / "adapter-study")
    run.add_argument("--name", help="the study's folder name (default: <task>-<model>)")
    run.add_argument("--python", default=sys.executable)
    run.add_argument("--timeout", type=float, help="stop a run after this many seconds")
    run.add_argument("--stop-after", type=float, help="stop every run this many seconds in")
    rep = sub.add_parser(
        "report", help="tables, results.json and results.png of every run under --out"
    )
    rep.add_argument("--out", type=Path, default=ROOT / "runs" / "adapter-study")
    fed = sub.add_parser("federate", help=argparse.SUPPRESS)
    fed.add_argument("folder")
    fed.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.command == "federate":
        return federate(args.folder, args.overrides)
    if args.command == "report":
        print(report(args.out))
        return 0
    default_data = {
        "categories": SHARED / "arxiv_dev" / "arxiv_dev.jsonl",
        "sms": SHARED / "sms_spam" / "SMSSpamCollection.tsv",
    }
    data = args.data or default_data.get(args.task, Path("--data"))
    if not data.exists():
        parser.error(
            f"--data {data} does not exist (categories: arxiv_dev.jsonl; sms: the SMS TSV; "
            "documents: a corpus folder)"
        )
    dataset, _ = task_overrides(args.task, data.resolve())
    model = MODELS.get(args.model, ["model=local", f"model.name_or_path={args.model}"])
    study = args.name or f"{args.task}-{Path(args.model).name}"
    jobs = [
        Job(
            name=row,
            seed=seed,
            runner=runner,
            overrides=merged(
                model, dataset, HEAD, overrides, [f"seed={seed}", "progress=false"], args.set
            ),
            folder=str(args.out / study / args.plan / row / f"seed{seed}"),
        )
        for seed in args.seeds  # seed-major: a study stopped early has every row's first seeds
        for row, runner, overrides in plan(args.plan, args.epochs, args.patience, args.only)
    ]
    if not jobs:
        parser.error(f"--only {args.only}: no such row in plan {args.plan}")
    (args.out / study).mkdir(parents=True, exist_ok=True)
    (args.out / study / f"{args.plan}-runs.json").write_text(
        json.dumps([asdict(j) for j in jobs], indent=1), encoding="utf-8"
    )
    run_jobs(jobs, args.jobs, args.python, args.timeout, args.stop_after)
    print(report(args.out))
    failed = [j for j in jobs if j.result.get("exit") != 0]
    for job in failed:
        why = f"FAILED, see {job.folder}/log.txt" if job.result else "not started (--stop-after)"
        print(f"{job.name} seed {job.seed}: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

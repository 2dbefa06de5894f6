"""Deployment speed: per-round overhead against Flower's floor, the speed-up of N cores, and
the time to a round's first update with a TinyLlama-shaped encoder, each with the node's worker.

    python scripts/bench_deploy.py all                   # every part, 2 clients (~30 min here)
    python scripts/bench_deploy.py overhead [--clients 2] [--rounds 5]
    python scripts/bench_deploy.py speedup [--clients 2 3] [--data PATH] [--examples 1000 2000]
    python scripts/bench_deploy.py first-update [--rounds 2]
    python scripts/bench_deploy.py all --smoke           # every part on tiny models (a test)

Every figure is printed with the machine's load average (``os.getloadavg()``) when it was taken.

overhead: a local cluster (a SuperLink and N SuperNodes on 127.0.0.1, each with its worker,
``car-fl worker``) runs, one after the other and with the same ServerApp and settings, car-fl
(a tiny random Llama, 400 synthetic examples, classifier mode) and an empty ClientApp that
replies at once (``scripts/floor_client_app.py``); car-fl also runs on a cluster without
workers (a new ClientApp process per message does the round). For rounds 2..R: per-round
overhead = round wall time - the slowest client's own work (its ``train-seconds``), car-fl's
against the floor's.
Also printed: how long a fresh process takes to import each ClientApp.

speedup: adapter + classifier mode, the offline MiniLM, the SMS data sampled to --examples
messages. A centralised run pinned to one core (``taskset``, one torch thread) for R x E epochs,
against a deployment of R rounds x E local epochs whose N SuperNodes (and so their ClientApp
processes) each run pinned to a core of their own, one torch thread each; the SuperLink and its
ServerApp (the aggregator) get one core too, the first core not given to a client, else core 0
(in adapter mode its evaluation of round r runs while round r + 1 trains, and the test split
is evaluated once at the end; ``--fl-overrides "eval.background=false
eval.test_every_round=true"`` evaluates both splits between the rounds, while the clients wait,
as before issue 36). Wall time from start to the
written results, both; N needs N cores (the GPU machine of the ``device`` tool has 16).
Each ``--examples`` value is one workload (today's short one, 1000, and one whose rounds are at
least ten times Flower's floor); each client trains in its worker.

first-update: a TinyLlama-shaped random Llama (22 layers, hidden 2048, bfloat16, saved in the
work folder), adapter + classifier, one SuperNode whose shard is one batch (one update per
round): round R's wall time with the node's worker (the encoder stays loaded) against without
it (the ClientApp process imports torch and loads the encoder in every round).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from car_fl.deploy.cluster import LocalCluster
from car_fl.deploy.commands import FlowerNotFound, check_flower, pinned
from car_fl.testing.tiny import tiny_overrides

PROJECT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = PROJECT.parent / "shared" / "data" / "sms_spam" / "SMSSpamCollection.tsv"
CONNECTION = "bench"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def floor_project(folder: Path) -> Path:
    """This project with the empty ClientApp (``scripts/floor_client_app.py``) as its
    ``client_app.py``.

    The app bundle carries the project's own ``car_fl`` and ``conf/`` (the ServerApp uses them),
    so the copy is the project itself (the same files travel) with only the ClientApp swapped.
    """
    skip = shutil.ignore_patterns(".git", ".venv", ".*_cache", "__pycache__", "runs", "outputs")
    shutil.copytree(PROJECT, folder, ignore=skip)
    shutil.copy(PROJECT / "scripts" / "floor_client_app.py", folder / "client_app.py")
    return folder


@contextlib.contextmanager
def cluster(
    folder: Path,
    *,
    clients: int,
    data: Path,
    client_cores: list[int] | None = None,
    server_core: int | None = None,
    one_thread: bool = False,
    workers: bool = False,
    settle: float = 8.0,
) -> Iterator[LocalCluster]:
    """A SuperLink and N CPU SuperNodes on 127.0.0.1, optionally each pinned to a core and
    each with its worker (started before its SuperNode, pinned to the same core)."""
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env |= ONE_THREAD if one_thread else {}
    with LocalCluster(folder, connection=CONNECTION, env=env) as local:
        # settle: let the SuperNodes connect before a run is timed
        local.start(
            clients,
            data=data,
            device="cpu",
            client_cores=client_cores,
            server_core=server_core,
            settle=settle,
            workers=workers,
        )
        yield local


def timed_run(local: LocalCluster, project: Path, overrides: str) -> tuple[float, dict[str, Any]]:
    """Wall seconds from ``flwr run`` to the run's end, and its ``metrics.json``."""
    result = local.run(project, overrides, timeout=3600, poll=0.5)
    if not result.completed:
        raise SystemExit(f"run on the local cluster did not complete: {result.status}")
    out = next(p.split("=", 1)[1] for p in overrides.split() if p.startswith("output_dir="))
    return result.seconds, json.loads((Path(out) / "metrics.json").read_text())


def later_rounds(metrics: dict[str, Any]) -> dict[str, Any]:
    """Rounds 2..R (round 1 fills the caches): mean round, slowest client work, overhead."""
    rows = metrics["history"][1:]
    rounds = [r["seconds"] for r in rows]
    work = [r["max_client_train_seconds"] for r in rows]
    return {
        "rounds": len(rows),
        "round_seconds": statistics.mean(rounds),
        "slowest_client_work_seconds": statistics.mean(work),
        "overhead_seconds": statistics.mean(r - w for r, w in zip(rounds, work, strict=True)),
        "per_round_overhead": [r - w for r, w in zip(rounds, work, strict=True)],
        "first_round_seconds": metrics["history"][0]["seconds"],
    }


def load() -> float:
    """The machine's 1-minute load average now (printed beside each figure)."""
    return round(os.getloadavg()[0], 2)


def import_seconds(module: str, repeats: int = 3, cwd: Path = PROJECT) -> float:
    """Median wall time of a fresh Python process in ``cwd`` that imports ``module`` and exits."""
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], cwd=cwd, check=True)
        times.append(time.perf_counter() - tick)
    return statistics.median(times)


# ------------------------------------------------------------------------------- overhead
def bench_overhead(
    work: Path, *, clients: int, rounds: int, settle: float = 8.0, repeats: int = 3
) -> dict[str, Any]:
    from car_fl.testing.tiny import build_llama, synthetic_examples, write_tsv

    work.mkdir(parents=True, exist_ok=True)
    model = build_llama(work / "llama")
    data = write_tsv(work / "data.tsv", synthetic_examples(400))
    common = " ".join(tiny_overrides(model, data)) + f" fl.clients={clients} fl.rounds={rounds}"
    floor_dir = floor_project(work / "floor-project")
    runs: dict[str, Any] = {}
    with cluster(
        work / "cluster", clients=clients, data=data, workers=True, settle=settle
    ) as local:
        # side by side on one cluster: car-fl (its workers train) and the empty app
        for name, project in (("car_fl", PROJECT), ("floor", floor_dir)):
            wall, metrics = timed_run(local, project, f"{common} output_dir={work / name}")
            runs[name] = {**later_rounds(metrics), "run_wall_seconds": wall, "load": load()}
    with cluster(work / "cluster-no-worker", clients=clients, data=data, settle=settle) as local:
        wall, metrics = timed_run(local, PROJECT, f"{common} output_dir={work / 'no-worker'}")
        runs["car_fl_no_worker"] = {**later_rounds(metrics), "run_wall_seconds": wall}
        runs["car_fl_no_worker"]["load"] = load()
    result = {
        "config": common,
        "clients": clients,
        **runs,
        "import_seconds": {
            "car_fl_client_app": import_seconds("client_app", repeats),
            "floor_client_app": import_seconds(
                "floor_client_app", repeats, cwd=PROJECT / "scripts"
            ),
            "python_only": import_seconds("sys", repeats),
        },
    }
    floor_overhead = result["floor"]["overhead_seconds"]
    result["ratio"] = result["car_fl"]["overhead_seconds"] / floor_overhead
    result["ratio_no_worker"] = result["car_fl_no_worker"]["overhead_seconds"] / floor_overhead
    result["import_seconds"]["load"] = load()
    return result


# -------------------------------------------------------------------------------- speed-up
def bench_speedup(
    work: Path,
    *,
    data: Path,
    examples: list[int],
    clients: list[int],
    rounds: int,
    local_epochs: int,
    model: str = "model=minilm",
    settle: float = 8.0,
    fl_overrides: str = "",
) -> dict[str, Any]:
    """One workload per ``examples`` value: centralised on one core vs N pinned clients
    (``fl_overrides``: Hydra overrides of the federated runs only, e.g. ``eval.*``)."""
    work.mkdir(parents=True, exist_ok=True)
    if model == "model=minilm":
        _warm_page_cache()
    return {
        str(n): bench_workload(
            work / f"examples-{n}",
            data=data,
            examples=n,
            clients=clients,
            rounds=rounds,
            local_epochs=local_epochs,
            model=model,
            settle=settle,
            fl_overrides=fl_overrides,
        )
        for n in examples
    }


def bench_workload(
    work: Path,
    *,
    data: Path,
    examples: int,
    clients: list[int],
    rounds: int,
    local_epochs: int,
    model: str,
    settle: float,
    fl_overrides: str = "",
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    available = sorted(os.sched_getaffinity(0))
    epochs = rounds * local_epochs
    common = (
        f"{model} dataset.path={data.resolve()} dataset.max_examples={examples} mode=adapter "
        "device=cpu progress=false"
    )
    # Centralised, one core, one thread: the same data and rounds x local epochs epochs
    central_out = work / "central"
    cmd = [
        sys.executable,
        "-m",
        "car_fl.centralized",
        *common.split(),
        f"train.epochs={epochs}",
        f"output_dir={central_out}",
        f"hydra.run.dir={work / 'hydra'}",
    ]
    env = {**os.environ, **ONE_THREAD, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    tick = time.perf_counter()
    subprocess.run(pinned(cmd, available[0]), env=env, cwd=work, check=True, capture_output=True)
    central_wall = time.perf_counter() - tick
    central = json.loads((central_out / "metrics.json").read_text())
    result: dict[str, Any] = {
        "config": common,
        "examples": examples,
        "epochs": epochs,
        "cores_available": len(available),
        "centralised": {
            "core": available[0],
            "wall_seconds": central_wall,
            "epoch_seconds": [r["seconds"] for r in central["history"]],
            # process start, imports, data, encoder load, results (not in any epoch)
            "outside_epochs_seconds": central_wall - sum(r["seconds"] for r in central["history"]),
            "final_test_top1": central["summary"]["final"]["test_top1"],
            "load": load(),
        },
        "federated": {},
    }
    for n in clients:
        if n > len(available):
            result["federated"][str(n)] = {"skipped": f"needs {n} cores, {len(available)} here"}
            continue
        server_core = available[n] if len(available) > n else available[0]
        folder = work / f"cluster-{n}"
        with cluster(
            folder,
            clients=n,
            data=data.resolve(),
            client_cores=available[:n],
            server_core=server_core,
            one_thread=True,
            workers=True,
            settle=settle,
        ) as local:
            overrides = (
                f"{common} fl.clients={n} fl.rounds={rounds} fl.local_epochs={local_epochs} "
                f"output_dir={folder / 'run'} {fl_overrides}"
            ).strip()
            wall, metrics = timed_run(local, PROJECT, overrides)
        rows = metrics["history"]
        clients_csv = list(csv.DictReader((folder / "run" / "clients.csv").open()))
        result["federated"][str(n)] = {
            "client_cores": available[:n],
            "server_core": server_core,
            "wall_seconds": wall,
            "speedup": central_wall / wall,
            "round_seconds": [r["seconds"] for r in rows],
            "slowest_client_work_seconds": [r["max_client_train_seconds"] for r in rows],
            # per round: what is not the slowest client's own work (Flower's floor, the
            # server's aggregation, and its evaluation where that runs between the rounds)
            "outside_clients_work_seconds": [
                r["seconds"] - r["max_client_train_seconds"] for r in rows
            ],
            "fl_overrides": fl_overrides,
            # flwr run, ServerApp start, data, encoder, round-0 evaluation, results
            "outside_rounds_seconds": wall - sum(r["seconds"] for r in rows),
            "client_torch_threads": sorted({int(float(r["torch_threads"])) for r in clients_csv}),
            "final_test_top1": metrics["summary"]["final"]["test_top1"],
            "load": load(),
        }
    return result


def _warm_page_cache() -> None:
    """Read the MiniLM files once, so that neither side pays the first disk read."""
    from car_fl.settings.compose import load_settings

    folder = Path(load_settings(["model=minilm"]).model.name_or_path)
    for path in folder.rglob("*"):
        if path.is_file():
            path.read_bytes()


# ---------------------------------------------------------------------------- first update
TINYLLAMA_SHAPE = {
    "hidden": 2048,
    "layers": 22,
    "intermediate": 5632,
    "heads": 32,
    "kv_heads": 4,
    "dtype": "bfloat16",
}
SMOKE_SHAPE = {"hidden": 64, "layers": 2}


def bench_first_update(
    work: Path, *, rounds: int, shape: dict[str, Any], settle: float = 8.0
) -> dict[str, Any]:
    """Round R's wall time (one update per round) with the node's worker against without it."""
    from car_fl.testing.tiny import build_llama, synthetic_examples, write_tsv

    work.mkdir(parents=True, exist_ok=True)
    tick = time.perf_counter()
    model = build_llama(work / "llama", **shape)
    build_seconds = time.perf_counter() - tick
    weight_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    # 40 examples: a training split of fewer than 32, so one batch of 32 is one update
    data = write_tsv(work / "data.tsv", synthetic_examples(40, num_labels=2))
    common = (
        " ".join(tiny_overrides(model, data))
        + f" mode=adapter fl.clients=1 fl.rounds={rounds} fl.local_epochs=1 train.batch_size=32"
    )
    result: dict[str, Any] = {
        "config": common,
        "shape": shape,
        "weight_bytes": weight_bytes,
        "build_seconds": build_seconds,
    }
    for name, workers in (("with_worker", True), ("without_worker", False)):
        folder = work / name
        with cluster(folder, clients=1, data=data, workers=workers, settle=settle) as local:
            wall, metrics = timed_run(local, PROJECT, f"{common} output_dir={folder / 'run'}")
        rows = metrics["history"]
        result[name] = {
            "round_seconds": [r["seconds"] for r in rows],
            "client_work_seconds": [r["max_client_train_seconds"] for r in rows],
            "run_wall_seconds": wall,
            "load": load(),
        }
    last = rounds - 1
    result["ratio_last_round"] = (
        result["without_worker"]["round_seconds"][last]
        / result["with_worker"]["round_seconds"][last]
    )
    return result


# ----------------------------------------------------------------------------------- report
def print_overhead(r: dict[str, Any]) -> None:
    imp = r["import_seconds"]
    lines = [f"deployment, {r['clients']} SuperNodes on 127.0.0.1, rounds 2..R:"]
    for key, label in (
        ("car_fl", "car-fl with workers"),
        ("floor", "empty app  "),
        ("car_fl_no_worker", "car-fl, no worker"),
    ):
        x = r[key]
        lines.append(
            f"  {label}: round {x['round_seconds']:.2f} s - slowest client's work "
            f"{x['slowest_client_work_seconds']:.2f} s = overhead {x['overhead_seconds']:.2f} s "
            f"per round (load {x['load']})"
        )
    lines += [
        f"  car-fl overhead / floor = {r['ratio']:.2f}x with workers (target <= 1.2x: "
        f"{'met' if r['ratio'] <= 1.2 else 'MISSED'}); {r['ratio_no_worker']:.2f}x without",
        f"  fresh process importing the ClientApp: car-fl {imp['car_fl_client_app']:.2f} s, "
        f"empty app {imp['floor_client_app']:.2f} s, bare Python {imp['python_only']:.2f} s "
        f"(load {imp['load']})",
    ]
    print("\n".join(lines))


def print_speedup(workloads: dict[str, Any]) -> None:
    targets = {2: 1.75, 3: 2.6}
    for r in workloads.values():
        c = r["centralised"]
        print(
            f"adapter + classifier, {r['config'].split()[0]}, {r['examples']} examples, "
            f"{r['epochs']} epochs in all:\n"
            f"  centralised on core {c['core']}: {c['wall_seconds']:.1f} s = epochs incl. "
            f"evaluation {' + '.join(f'{s:.1f}' for s in c['epoch_seconds'])} s + start-up and "
            f"results {c['outside_epochs_seconds']:.1f} s; top-1 {c['final_test_top1']:.4f} "
            f"(load {c['load']})"
        )
        for n, f in r["federated"].items():
            if "skipped" in f:
                print(f"  {n} clients: skipped ({f['skipped']})")
                continue
            target = targets.get(int(n))
            verdict = (
                f" (target >= {target}x: {'met' if f['speedup'] >= target else 'MISSED'})"
                if target
                else ""
            )
            work = " + ".join(f"{s:.1f}" for s in f["slowest_client_work_seconds"])
            outside = " + ".join(f"{s:.1f}" for s in f["outside_clients_work_seconds"])
            print(
                f"  {n} clients (workers) on cores {f['client_cores']}, server on core "
                f"{f['server_core']}: {f['wall_seconds']:.1f} s = {f['speedup']:.2f}x{verdict}\n"
                f"    = rounds {' + '.join(f'{s:.1f}' for s in f['round_seconds'])} s (of which "
                f"the slowest client's work {work} s; outside it {outside} s) + start-up, "
                f"round-0 evaluation, the end's evaluation and results "
                f"{f['outside_rounds_seconds']:.1f} s; torch threads per client "
                f"{f['client_torch_threads']}; top-1 {f['final_test_top1']:.4f} (load {f['load']})"
                + (f"; {f['fl_overrides']}" if f.get("fl_overrides") else "")
            )


def print_first_update(r: dict[str, Any]) -> None:
    shape = r["shape"]
    print(
        f"first update of a round, adapter + classifier, random Llama {shape['layers']} layers x "
        f"hidden {shape['hidden']} ({r['weight_bytes'] / 2**30:.2f} GiB on disk), one node, "
        "one update per round:"
    )
    for key, label in (("with_worker", "with the worker"), ("without_worker", "without it  ")):
        x = r[key]
        print(
            f"  {label}: rounds {' + '.join(f'{s:.1f}' for s in x['round_seconds'])} s (client's "
            f"work {' + '.join(f'{s:.1f}' for s in x['client_work_seconds'])} s) (load "
            f"{x['load']})"
        )
    print(f"  last round without / with the worker = {r['ratio_last_round']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=("all", "overhead", "speedup", "first-update"))
    parser.add_argument("--clients", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the overhead part")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="SMSSpamCollection.tsv")
    parser.add_argument(
        "--examples", type=int, nargs="+", default=[1000, 2000], help="SMS sample per workload"
    )
    parser.add_argument("--fl-rounds", type=int, default=2, help="rounds of the speedup part")
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument(
        "--fl-overrides",
        default="",
        help="Hydra overrides of the speedup part's federated runs only, e.g. "
        "'eval.background=false eval.test_every_round=true' (evaluation as before issue 36)",
    )
    parser.add_argument("--json", type=Path, default=Path("runs/bench-deploy.json"))
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every part on tiny random Llamas and synthetic data, shortly, the overhead part "
        "with one SuperNode and one import timing (checks that the "
        "script runs to the end; its numbers mean nothing)",
    )
    args = parser.parse_args(argv)
    try:
        check_flower()
    except FlowerNotFound as err:
        parser.exit(1, f"bench_deploy.py: {err}\n")
    if args.part in ("all", "speedup") and not args.smoke and not args.data.is_file():
        parser.error(f"{args.data} not found; pass --data path/to/SMSSpamCollection.tsv")
    results: dict[str, Any] = {"cpus": os.cpu_count(), "smoke": args.smoke}
    settle = 2.0 if args.smoke else 8.0
    with tempfile.TemporaryDirectory(prefix="car-fl-bench-deploy-") as tmp:
        work = Path(tmp)
        model = "model=minilm"
        if args.smoke:
            from car_fl.testing.tiny import build_llama, synthetic_examples, write_tsv

            args.rounds, args.fl_rounds, args.local_epochs, args.examples = 2, 2, 1, [200]
            model = f"model=local model.name_or_path={build_llama(work / 'smoke-llama')}"
            args.data = write_tsv(work / "smoke.tsv", synthetic_examples(200, num_labels=2))
        if args.part in ("all", "overhead"):
            print("per-round overhead in deployment vs an empty ClientApp ...", flush=True)
            results["overhead"] = bench_overhead(
                work / "overhead",
                clients=1 if args.smoke else args.clients[0],  # a smoke run: its code paths
                rounds=args.rounds,
                settle=settle,
                repeats=1 if args.smoke else 3,
            )
        if args.part in ("all", "speedup"):
            print("speed-up of N pinned clients vs one pinned core ...", flush=True)
            results["speedup"] = bench_speedup(
                work / "speedup",
                data=args.data,
                examples=args.examples,
                clients=args.clients,
                rounds=args.fl_rounds,
                local_epochs=args.local_epochs,
                model=model,
                settle=settle,
                fl_overrides=args.fl_overrides,
            )
        if args.part in ("all", "first-update"):
            print("time to a round's first update, TinyLlama-shaped Llama ...", flush=True)
            results["first_update"] = bench_first_update(
                work / "first-update",
                rounds=2,
                shape=SMOKE_SHAPE if args.smoke else TINYLLAMA_SHAPE,
                settle=settle,
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    if "overhead" in results:
        print_overhead(results["overhead"])
    if "speedup" in results:
        print_speedup(results["speedup"])
    if "first_update" in results:
        print_first_update(results["first_update"])
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

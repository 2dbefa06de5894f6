"""The retrieval endpoint under load, against in-process retrieve of the same requests.

    python scripts/bench_serve.py --json runs/bench-serve.json     # MiniLM and SmolLM2 on SMS
    python scripts/bench_serve.py --smoke --json /tmp/bench-serve.json   # tiny models (a test)

Per model it trains a checkpoint centrally on the SMS Spam Collection (``train.epochs``), then
on the same machine, per ``--queries-per-request`` n: (1) in-process, the whole test split in
one ``retrieve`` call (car-fl's own batching: the ceiling); (2) in-process as the clients would
ask without a service: ``--clients`` threads in one process, each calling
``load_retriever(...).retrieve`` on n queries at a time, with as many torch threads as the
replica gets (the fair baseline: the same requests, sizes and threads); (3) ``car-fl serve``'s
app (:func:`car_fl.serving.retrieval_service.start`, one replica with every CPU) on 127.0.0.1,
``--clients`` threads each sending n test queries per request until the split is answered
``--rounds`` times: queries per second, p50 and p99 latency, every non-2xx or failed request
counted. The load average is recorded beside each figure. Writes JSON and prints the command
that reproduces it. Threads with httpx, not locust: the load is one POST shape and the figures
are four numbers; a bounded thread pool says exactly what was sent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SMS = ROOT.parent / "shared" / "data" / "sms_spam" / "SMSSpamCollection.tsv"


def checkpoint_for(model: str, data: Path, work: Path, *, epochs: int, smoke: bool) -> Path:
    """A centrally trained checkpoint of ``model`` on ``data`` (its best)."""
    from car_fl.settings.compose import load_settings
    from car_fl.standalone.centralized import run_centralized
    from car_fl.testing.tiny import build_llama, tiny_overrides

    if smoke:
        base = tiny_overrides(build_llama(work / "tiny-llama"), data, cache_dir=work / "cache")
    else:
        base = [f"model={model}", f"dataset.path={data}", f"cache_dir={work / 'cache'}"]
        base += ["progress=false", "device=cpu"]
    run = work / f"run-{model}"
    if (run / "checkpoints" / "best").is_dir():  # a --work of an earlier run: its checkpoint
        return run / "checkpoints" / "best"
    run_centralized(load_settings([*base, f"train.epochs={epochs}"]), run)
    return run / "checkpoints" / "best"


def test_queries(checkpoint: Path) -> list[str]:
    """The test split's texts, as the checkpoint's settings split them."""
    from car_fl.data.splits import load_splits
    from car_fl.results.run import load_checkpoint

    ckpt = load_checkpoint(checkpoint)
    splits = load_splits(ckpt.settings.dataset, seed=ckpt.settings.seed, label_map=ckpt.label_map)
    return list(splits.test["text"])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def in_process(checkpoint: Path, queries: list[str], *, k: int) -> dict[str, Any]:
    """``retrieve`` of every query in one call, after one warm-up call."""
    from car_fl.serving.checkpoint import load_retriever

    retriever = load_retriever(checkpoint, device="cpu")
    retriever.retrieve(queries[:32], k)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    retriever.retrieve(queries, k)
    seconds = time.perf_counter() - started
    return {
        "queries": len(queries),
        "seconds": seconds,
        "qps": len(queries) / seconds,
        "load": [load_before, os.getloadavg()[0]],
    }


def in_process_concurrent(
    checkpoint: Path, queries: list[str], *, k: int, clients: int, per_request: int
) -> dict[str, Any]:
    """The fair baseline: ``clients`` threads of one process, each ``retrieve`` on
    ``per_request`` queries at a time (one loaded retriever, shared, as an app would)."""
    from car_fl.serving.checkpoint import load_retriever

    retriever = load_retriever(checkpoint, device="cpu")
    requests = [queries[i : i + per_request] for i in range(0, len(queries), per_request)]
    retriever.retrieve(queries[:per_request], k)
    load_before = os.getloadavg()[0]
    cpu_before = time.process_time()
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda asked: retriever.retrieve(asked, k), requests))
    seconds = time.perf_counter() - started
    return {
        "queries": len(queries),
        "clients": clients,
        "queries_per_request": per_request,
        "seconds": seconds,
        "cpu_s": time.process_time() - cpu_before,
        "qps": len(queries) / seconds,
        "load": [load_before, os.getloadavg()[0]],
    }


#: Which Ray processes are whose (their process titles), for the CPU each role used.
ROLES = {"ServeReplica": "replica", "ProxyActor": "proxy", "ServeController": "controller"}


def cpu_by_role() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process (the clients), Serve's replica,
    proxy and controller, and the rest of Ray (GCS, raylet, workers), all this process's tree."""
    import psutil

    me = psutil.Process()
    times = me.cpu_times()
    out = {"clients": times.user + times.system}
    for child in me.children(recursive=True):
        try:
            title = " ".join(child.cmdline()) or child.name()
            t = child.cpu_times()
        except psutil.Error:
            continue
        role = next((r for key, r in ROLES.items() if key in title), "ray")
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def under_load(
    checkpoint: Path,
    queries: list[str],
    *,
    k: int,
    clients: int,
    rounds: int,
    cpus: int,
    batch_wait_ms: float,
    per_request: int = 1,
) -> dict[str, Any]:
    """The endpoint on 127.0.0.1 with ``clients`` threads, ``per_request`` queries a request."""
    import httpx

    from car_fl.deploy.ports import free_port
    from car_fl.serving.retrieval_service import RetrievalConfig, start, stop

    service = RetrievalConfig(
        port=free_port(), cpus_per_replica=cpus, batch_wait_s=batch_wait_ms / 1000
    )
    url = start(str(checkpoint), service, device="cpu")
    try:
        asked = [queries[i : i + per_request] for i in range(0, len(queries), per_request)]
        work = asked * rounds
        latencies: list[float] = []
        failures: dict[str, int] = {}
        lock = threading.Lock()
        local = threading.local()

        def one(texts: list[str]) -> None:
            if not hasattr(local, "http"):
                local.http = httpx.Client(base_url=url, timeout=120)
            started = time.perf_counter()
            try:
                status = local.http.post("/retrieve", json={"queries": texts, "k": k}).status_code
            except httpx.HTTPError as err:
                status, name = 0, type(err).__name__
            else:
                name = str(status)
            with lock:
                if 200 <= status < 300:
                    latencies.append(time.perf_counter() - started)
                else:
                    failures[name] = failures.get(name, 0) + 1

        with ThreadPoolExecutor(clients) as pool:  # the same threads, so the same connections
            list(pool.map(one, asked[:clients]))  # warm-up: every client's connection
            latencies.clear()
            load_before = os.getloadavg()[0]
            cpu_before = cpu_by_role()
            started = time.perf_counter()
            list(pool.map(one, work))
            seconds = time.perf_counter() - started
            cpu = {r: t - cpu_before.get(r, 0.0) for r, t in cpu_by_role().items()}
    finally:
        stop()
    answered_queries = sum(len(texts) for texts in work) if not failures else None
    return {
        "requests": len(work),
        "queries_per_request": per_request,
        "answered": len(latencies),
        "not_2xx": failures,
        "seconds": seconds,
        "qps": (answered_queries or len(latencies) * per_request) / seconds,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "p99_ms": 1000 * percentile(latencies, 0.99) if latencies else None,
        "load": [load_before, os.getloadavg()[0]],
        "clients": clients,
        "cpus_per_replica": cpus,
        "batch_wait_ms": batch_wait_ms,
        "cpu_s": {role: round(t, 2) for role, t in cpu.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["minilm", "smollm2"])
    parser.add_argument("--data", type=Path, default=SMS, help="the SMS Spam Collection TSV")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--queries-per-request",
        type=int,
        nargs="+",
        default=[1, 16],
        help="queries each request holds; several: one in-process and one served run each",
    )
    parser.add_argument("--rounds", type=int, default=1, help="times the test split is sent")
    parser.add_argument("-k", type=int, default=2, help="documents per query (SMS: 2 labels)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        nargs="+",
        default=[5.0],
        help="how long a batch waits to fill (car-fl serve --batch-wait-ms); several: one "
        "served run each",
    )
    parser.add_argument("--work", type=Path, default=None, help="checkpoints (default: a temp)")
    parser.add_argument("--json", type=Path, default=Path("runs/bench-serve.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny models and data (a test)")
    args = parser.parse_args(argv)
    import torch

    from car_fl.testing.tiny import synthetic_examples, write_tsv

    torch.set_num_threads(args.cpus)  # as many threads as the replica gets
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.models, args.clients = ["tiny"], min(args.clients, 8)
        args.data = write_tsv(work / "smoke.tsv", synthetic_examples(200, num_labels=2))
    elif not args.data.is_file():
        parser.error(f"--data {args.data} not found (the SMS Spam Collection TSV)")
    command = " ".join(["python", "scripts/bench_serve.py", *(argv or sys.argv[1:])])
    results: dict[str, Any] = {"command": command, "cpus": os.cpu_count(), "models": {}}
    for model in args.models:
        checkpoint = checkpoint_for(model, args.data, work, epochs=args.epochs, smoke=args.smoke)
        queries = test_queries(checkpoint)
        alone = in_process(checkpoint, queries, k=args.k)
        runs = []
        fair: dict[int, dict[str, Any]] = {}
        for wait, per_request in [
            (w, n) for n in args.queries_per_request for w in args.batch_wait_ms
        ]:
            if per_request not in fair:
                fair[per_request] = in_process_concurrent(
                    checkpoint, queries, k=args.k, clients=args.clients, per_request=per_request
                )
            served = under_load(
                checkpoint,
                queries,
                k=args.k,
                clients=args.clients,
                rounds=args.rounds,
                cpus=args.cpus,
                batch_wait_ms=wait,
                per_request=per_request,
            )
            baseline = fair[per_request]
            served["ratio_to_in_process"] = served["qps"] / alone["qps"]
            served["in_process_same_requests"] = baseline
            served["ratio_to_same_requests"] = served["qps"] / baseline["qps"]
            runs.append(served)
            print(
                f"{model}, {per_request} queries a request, {args.clients} clients: in-process "
                f"all at once {alone['qps']:.0f} q/s, the same requests in-process "
                f"{baseline['qps']:.0f} q/s (load {baseline['load'][1]:.1f}); "
                f"served (batch wait {wait:g} ms) {served['qps']:.0f} q/s = "
                f"{served['ratio_to_same_requests']:.2f}x the same requests, "
                f"{served['ratio_to_in_process']:.2f}x all at once, "
                f"p50 {served['p50_ms']:.0f} ms, p99 "
                f"{served['p99_ms']:.0f} ms, {served['answered']}/{served['requests']} answered, "
                f"not 2xx {served['not_2xx'] or 0} (load {served['load'][1]:.1f}); CPU s "
                + ", ".join(f"{r} {t:.1f}" for r, t in served["cpu_s"].items()),
                flush=True,
            )
        results["models"][model] = {"in_process": alone, "served": runs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.json}; reproduce: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

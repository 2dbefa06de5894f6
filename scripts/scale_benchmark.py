"""A synthetic 100,000-document corpus in classifier mode: the dense document head against the
mixture of experts.

    python scripts/scale_benchmark.py --out runs/bench/scale            # 100,000 documents
    python scripts/scale_benchmark.py --smoke --out /tmp/scale          # a few seconds

No encoder: the documents' embeddings are synthetic, ``(documents, dim)`` unit vectors around
``topics`` Gaussian topic centres; a query is a noisy copy of its document seen through a fixed
linear distortion (``QUERY_DISTORTION``), which a trained query map can learn to undo. Each
variant is car-fl's own code on these features: :func:`car_fl.model.retriever.build_retriever`
(``approach=document`` or ``approach=moe``, its balanced clustering and gate included),
:func:`car_fl.training.train.train_epoch` and :func:`car_fl.training.train.evaluate` (one batch
of scores at a time). Measured per variant, each in its own process so that peak memory is
its own: seconds per epoch, peak RSS (``resource.getrusage``), head multiply-adds per query,
the bytes a client is sent per round (the server's :class:`~car_fl.server.expert_plan.ExpertPlan`
with ``moe.send=schedule``, :func:`~car_fl.protocol.messages.payload_bytes`; a reply is exactly
what was sent, so the same bytes go back) and Recall@1/10 and MRR on held-out queries.

Results: ``results.json``, ``results.csv`` and ``table.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: How far a query's embedding is from its document's: ``q = (d + noise·g/√dim) (I + A)``.
QUERY_DISTORTION = 0.5
VARIANTS = ("dense", "moe")
COMMON = [
    "approach=document",
    "head.query_map=linear",
    "train.lr=1e-3",
    "train.rows_lr=1e-4",
    "device=cpu",
    "progress=false",
    "seed=0",
]


def rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthetic(args: argparse.Namespace) -> dict[str, Any]:
    """Documents ``(N, dim)``, train and test queries with their documents' indices."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(args.seed)
    n, dim = args.documents, args.dim
    centres = F.normalize(torch.randn(args.topics, dim, generator=g), dim=-1)
    topic = torch.randint(args.topics, (n,), generator=g)
    spread = torch.randn(n, dim, generator=g) / dim**0.5
    documents = F.normalize(centres[topic] + args.spread * spread, dim=-1)
    distortion = torch.eye(dim) + QUERY_DISTORTION * torch.randn(dim, dim, generator=g) / dim**0.5

    def queries(of: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(len(of), dim, generator=g) / dim**0.5
        return F.normalize((documents[of] + args.noise * noise) @ distortion, dim=-1)

    train_of = torch.arange(n).repeat(args.train_per_document)
    train_of = train_of[torch.randperm(len(train_of), generator=g)][: args.train_queries or None]
    test_of = torch.randint(n, (args.test_queries,), generator=g)
    return {
        "documents": documents,
        "train": (queries(train_of), train_of),
        "test": (queries(test_of), test_of),
    }


def settings_for(variant: str, args: argparse.Namespace) -> Any:
    from car_fl.settings.compose import load_settings

    overrides = [*COMMON, f"train.batch_size={args.batch_size}", "train.eval_batch_size=256"]
    if variant == "moe":
        overrides += [
            "approach=moe",
            f"moe.experts={args.experts}",
            f"moe.route={args.route}",
            *([f"moe.eval_route={args.eval_route}"] if args.eval_route else []),
            "moe.send=schedule",
            f"moe.schedule_blocks={args.blocks}",
            "moe.iterations=5",
        ]
    return load_settings(overrides)


def bytes_per_client(model: Any, settings: Any, args: argparse.Namespace) -> dict[str, int]:
    """What the server sends each of ``args.clients`` clients in round 1 (the most of them)."""
    from car_fl.heads.experts import MixtureHead
    from car_fl.protocol.messages import payload_bytes, to_record
    from car_fl.server.expert_plan import ExpertPlan

    state = model.trainable_state_dict()
    if not isinstance(model.head, MixtureHead):
        return {"bytes_per_client_round": payload_bytes(to_record(state)), "layout_bytes": 0}
    layout = model.head.layout.to_text()
    plan = ExpertPlan.from_settings(settings, state.keys(), layout)
    sent = [
        payload_bytes(to_record({name: state[name] for name in plan.sent(1, place)})) + len(layout)
        for place in range(args.clients)
    ]
    return {"bytes_per_client_round": max(sent), "layout_bytes": len(layout)}


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, train and evaluate one head; everything this process measured."""
    import torch

    from car_fl.heads.experts import MixtureHead
    from car_fl.model.features import LocalData
    from car_fl.model.retriever import build_retriever
    from car_fl.training.train import evaluate, make_optimizer, train_epoch

    torch.set_num_threads(args.threads)
    data = synthetic(args)
    rss_data = rss_mib()
    settings = settings_for(variant, args)
    documents = data["documents"]
    started = time.perf_counter()
    model = build_retriever(
        settings, len(documents), hidden_size=args.dim, document_features=documents
    )
    build_seconds = time.perf_counter() - started  # the mixture's clustering is in here
    optimizer = make_optimizer(model, settings.train)
    train = LocalData(labels=data["train"][1], features=data["train"][0])
    test = LocalData(labels=data["test"][1], features=data["test"][0])
    top_k = [1, 10]
    before = evaluate(model, test, batch_size=settings.train.eval_batch_size, top_k=top_k)
    epochs = []
    for epoch in range(args.epochs):
        started = time.perf_counter()
        result = train_epoch(
            model,
            train,
            optimizer,
            batch_size=settings.train.batch_size,
            seed=settings.seed,
            epoch=epoch,
            progress=False,
        )
        epochs.append({"seconds": time.perf_counter() - started, "loss": result.loss})
    started = time.perf_counter()
    after = evaluate(model, test, batch_size=settings.train.eval_batch_size, top_k=top_k)
    eval_seconds = time.perf_counter() - started
    head = model.head
    dense_macs = len(documents) * args.dim
    macs = head.head_flops_per_query() if isinstance(head, MixtureHead) else dense_macs
    return {
        "variant": variant,
        "documents": len(documents),
        "dim": args.dim,
        "train_queries": len(train),
        "test_queries": len(test),
        "epochs": args.epochs,
        "experts": args.experts if variant == "moe" else None,
        "route": args.route if variant == "moe" else None,
        "eval_route": (args.eval_route or args.route) if variant == "moe" else None,
        "blocks": args.blocks if variant == "moe" else None,
        "build_seconds": build_seconds,
        "steps_per_epoch": -(-len(train) // settings.train.batch_size),
        "seconds_per_epoch": sum(e["seconds"] for e in epochs) / max(len(epochs), 1),
        "eval_seconds": eval_seconds,
        "train_loss": epochs[-1]["loss"] if epochs else None,
        "peak_rss_mib": rss_mib(),
        "rss_after_data_mib": rss_data,
        "head_macs_per_query": macs,
        "query_map_macs_per_query": args.dim * args.dim,
        **bytes_per_client(model, settings, args),
        "untrained": {k: before[k] for k in ("recall@1", "recall@10", "mrr")},
        **{k: after[k] for k in ("recall@1", "recall@10", "mrr")},
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| head | s/epoch | eval s | peak RSS MiB | head MACs/query | bytes/client/round "
        "| R@1 | R@10 | MRR | R@10 untrained |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        name = (
            f"MoE {r['experts']} experts, route {r['route']} (evaluation "
            f"{r.get('eval_route') or r['route']}), schedule {r['blocks']} blocks"
            if r["variant"] == "moe"
            else "dense document head"
        )
        lines.append(
            f"| {name} | {r['seconds_per_epoch']:.1f} | {r['eval_seconds']:.1f} "
            f"| {r['peak_rss_mib']:,.0f} | {r['head_macs_per_query']:,} "
            f"| {r['bytes_per_client_round']:,} | {r['recall@1']:.3f} | {r['recall@10']:.3f} "
            f"| {r['mrr']:.3f} | {r['untrained']['recall@10']:.3f} |"
        )
    return head + "\n".join(lines) + "\n"


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    by = {r["variant"]: r for r in rows}
    if set(by) != set(VARIANTS):
        return {}
    dense, moe = by["dense"], by["moe"]
    return {
        "head_macs_ratio": dense["head_macs_per_query"] / moe["head_macs_per_query"],
        "bytes_ratio": dense["bytes_per_client_round"] / moe["bytes_per_client_round"],
        "recall@10_gap_points": 100 * (dense["recall@10"] - moe["recall@10"]),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench/scale"))
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it all runs")
    p.add_argument("--documents", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--topics", type=int, default=1_000)
    p.add_argument("--spread", type=float, default=1.0, help="documents around their topic")
    p.add_argument("--noise", type=float, default=1.5, help="queries around their document")
    p.add_argument("--train-per-document", type=int, default=1)
    p.add_argument("--train-queries", type=int, default=0, help="cap (0: all)")
    p.add_argument("--test-queries", type=int, default=10_000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--route", type=int, default=4)
    p.add_argument("--eval-route", type=int, default=None, help="moe.eval_route (default: --route)")
    p.add_argument("--blocks", type=int, default=8, help="moe.schedule_blocks")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=VARIANTS, default=None, help="one variant, in-process")
    args = p.parse_args(argv)
    if args.smoke:
        args.documents, args.dim, args.topics = 2_000, 32, 40
        args.test_queries, args.experts, args.route, args.blocks = 500, 16, 2, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.only is not None:  # a child: one variant, its result on stdout's last line
        print(json.dumps(run_variant(args.only, args)))
        return 0
    argv = list(sys.argv[1:] if argv is None else argv)
    rows = []
    for variant in VARIANTS:  # each in its own process: its own peak memory
        done = subprocess.run(
            [sys.executable, __file__, *argv, "--only", variant],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{variant}: done", flush=True)
    summary = {"rows": rows, "ratios": ratios(rows), "load_average": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    flat = [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in rows]
    with (args.out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    text = table(rows)
    (args.out / "table.md").write_text(text)
    print(text)
    print(json.dumps(summary["ratios"]))
    print(f"load average at the end: {summary['load_average']}")
    out = args.json or args.out / "results.json"
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

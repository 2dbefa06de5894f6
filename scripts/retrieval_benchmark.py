"""Retrieval on a document corpus: MIPS, kNN and CaR variants, centralised and federated.

    python scripts/arxiv_corpus.py ../shared/data/arxiv_dev/arxiv_dev.jsonl runs/arxiv_dev
    python scripts/retrieval_benchmark.py --corpus runs/arxiv_dev --out runs/bench/retrieval

Every variant is a car-fl run (``run_centralized``, or a federation in one process with
:func:`car_fl.simulation.in_process.run_local`) on frozen MiniLM features (car-fl's feature
cache: the first run encodes, the others read). The model of each run is the one selected on
validation (``val_top1``); the table reports its held-out test queries: Recall@1/5/10, MRR,
nDCG@10, and Recall@10 on the queries of *new* documents (no training query) and of the others.
Results: ``results.jsonl`` and ``results.csv`` (one row per variant) and ``table.md``; each
row names its overrides, so one variant re-runs with ``--only NAME``. Every row also gives the
starting point (epoch or round 0: the untrained head) beside the selected model.

Tunable from the command line: Hydra overrides after the variant's own (``--set KEY=VALUE``
or positional ``KEY=VALUE``: epochs, batch size, ``dataset.new_fraction``, the model, ...),
and ``--clients N [--rounds R] [--dp-epsilon E]`` to run any variant as an N-client
federation in one process, optionally with record-level DP-SGD::

    python scripts/retrieval_benchmark.py --corpus runs/arxiv_dev --out runs/bench/fl \\
        --only query_map --clients 2 --rounds 1 --dp-epsilon 3 train.epochs=1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

# The variants: (federated, overrides). Learning rates and epochs are fixed in advance (no
# tuning on test); each run keeps its best round or epoch on validation.
DOCUMENT = ["approach=document", "head.query_map=linear", "train.lr=1e-3", "train.rows_lr=1e-4"]
FUSION = ["approach=fusion", "head.query_map=linear", "train.lr=1e-3", "train.rows_lr=1e-4"]
MOE = ["approach=moe", "head.query_map=linear", "train.lr=1e-3", "train.rows_lr=1e-4"]
MOE_LAYOUT = ["moe.experts=32", "moe.route=4", "moe.iterations=5"]
FL = ["fl.clients=3", "fl.min_clients=3", "fl.partitioning=iid", "fl.local_epochs=1"]
VARIANTS: dict[str, tuple[bool, list[str]]] = {
    "mips": (False, ["approach=mips", "head.similarity=cosine"]),
    # Untrained heads (evaluated as built, see UNTRAINED): the document head starts as MIPS;
    # the mixture of experts at start shows what routing alone costs.
    "document_untrained": (False, [*DOCUMENT]),
    "moe_untrained": (False, [*MOE, *MOE_LAYOUT]),
    "knn": (False, ["approach=knn", "head.similarity=cosine", "head.knn_k=10"]),
    "document": (False, [*DOCUMENT, "train.epochs=2"]),
    "document_rows_only": (False, [*DOCUMENT, "head.query_map=none", "train.epochs=2"]),
    "moe": (False, [*MOE, *MOE_LAYOUT, "train.epochs=2"]),
    "query_map": (False, [*DOCUMENT, "head.train_rows=false", "train.epochs=1"]),
    # BM25 over the documents' words alone (car_fl.heads.lexical; no encoder, nothing trained)
    "bm25": (False, [*FUSION]),
    # the untrained document head (= cosine MIPS) fused with BM25, and the trained one
    "fusion_untrained": (False, [*FUSION]),
    "fusion": (False, [*FUSION, "train.epochs=2"]),
    # the soft-embedding adapter before the frozen encoder, with the document head (rows and
    # query map frozen: what the adapter alone adds), 1 epoch of batch 16
    "adapter_document": (
        False,
        [
            "approach=adapter_document",
            "head.query_map=none",
            "head.train_rows=false",
            "train.adapter_lr=1e-4",
            "train.batch_size=16",
            "train.epochs=1",
        ],
    ),
    "fl_document": (True, [*DOCUMENT, *FL, "fl.rounds=2"]),
    "fl_fusion": (True, [*FUSION, *FL, "fl.rounds=2"]),
    "fl_query_map": (True, [*DOCUMENT, *FL, "fl.rounds=2", "head.train_rows=false"]),
    "fl_moe_schedule": (
        True,
        [*MOE, *MOE_LAYOUT, *FL, "fl.rounds=2", "moe.send=schedule", "moe.schedule_blocks=3"],
    ),
    "fl_document_dp_eps3": (
        True,
        [
            *DOCUMENT,
            *FL,
            "fl.rounds=1",
            "head.train_rows=false",
            "dp=record",
            "dp.target_epsilon=3",
            "dp.delta=1e-5",
            "dp.sample_rate=0.01",
            "dp.clip=1.0",
            "train.lr=3e-3",
        ],
    ),
}
#: Variants evaluated before any training (no epoch): the head as :func:`build_retriever` makes it.
UNTRAINED = ("document_untrained", "moe_untrained", "fusion_untrained")
COLUMNS = ("recall@1", "recall@5", "recall@10", "mrr", "ndcg@10")


#: What every variant shares before its own overrides: 10 % new documents (held out of
#: training on purpose, to measure documents that arrive later; the corpus config's default is
#: none) and batches of 64, which make an epoch of ~11k training queries ~180 steps, not the
#: schema default 4's ~2,800.
BENCHMARK = ["dataset.new_fraction=0.1", "train.batch_size=64"]


def corpus_overrides(corpus: Path) -> list[str]:
    return [
        "dataset=corpus",
        f"dataset.path={corpus / 'queries.jsonl'}",
        f"dataset.documents_path={corpus / 'documents.jsonl'}",
        "model=minilm",
        "model.document_max_length=256",
        "device=cpu",
        "progress=false",
        *BENCHMARK,
    ]


def federation_overrides(
    *, clients: int | None, rounds: int | None, epsilon: float | None
) -> list[str]:
    """``--clients``/``--rounds``/``--dp-epsilon`` as overrides (any variant, federated).

    ``--dp-epsilon`` is record-level DP-SGD (``dp=record``) at that ε per client for the whole
    run (δ = 10⁻⁵, sampling rate 0.01, clip 1); the query map is then the only trained part
    (``head.train_rows=false``), as in ``fl_document_dp_eps3``.
    """
    if clients is not None and clients < 1:
        raise ValueError(f"--clients must be >= 1, got {clients}")
    if rounds is not None and rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if epsilon is not None and not epsilon > 0:
        raise ValueError(f"--dp-epsilon must be > 0, got {epsilon}")
    out: list[str] = []
    if clients is not None:
        out += [
            f"fl.clients={clients}",
            f"fl.min_clients={clients}",
            "fl.partitioning=iid",
            "fl.local_epochs=1",
        ]
    if rounds is not None:
        out.append(f"fl.rounds={rounds}")
    if epsilon is not None:
        out += [
            "dp=record",
            f"dp.target_epsilon={epsilon:g}",
            "dp.delta=1e-5",
            "dp.sample_rate=0.01",
            "dp.clip=1.0",
            "head.train_rows=false",
        ]
    return out


def head_cost(summary: dict[str, Any], settings: Any) -> dict[str, float]:
    """Head multiply-adds per query (gate and routed experts for a mixture; maps excluded)."""
    from car_fl.heads.clustering import ExpertLayout
    from car_fl.settings.schema import HeadKind

    documents, dim = int(summary["num_labels"]), 384
    dense = documents * dim
    if settings.head.kind is not HeadKind.MOE:
        return {"head_flops": dense, "head_flops_vs_dense": 1.0}
    if "moe_head_flops" in summary:  # measured on the model itself
        flops = int(summary["moe_head_flops"])
        return {"head_flops": flops, "head_flops_vs_dense": dense / flops}
    ckpt = Path(settings.output_dir) / "checkpoints" / "final" / "meta.json"
    extra = json.loads(ckpt.read_text(encoding="utf-8")).get("extra", {}) if ckpt.is_file() else {}
    sizes = ExpertLayout.from_text(extra["moe_layout"]).sizes() if "moe_layout" in extra else None
    largest = [] if sizes is None else sorted(sizes.tolist(), reverse=True)[: settings.moe.route]
    flops = (settings.moe.experts + sum(largest)) * dim
    return {"head_flops": flops, "head_flops_vs_dense": dense / flops if flops else float("nan")}


def evaluate_untrained(settings: Any) -> dict[str, Any]:
    """The summary of a head evaluated as built (rows = the documents' embeddings)."""
    from car_fl.data.splits import load_splits
    from car_fl.model.retriever import build_retriever
    from car_fl.training.train import HeldOut, LazyRetriever

    splits = load_splits(settings.dataset, seed=settings.seed)
    lazy = LazyRetriever(settings, splits)
    held_out = HeldOut.prepare(settings, splits, get_model=lazy)
    assert held_out.test.features is not None
    model = build_retriever(
        settings,
        len(splits.label_map),
        hidden_size=int(held_out.test.features.shape[1]),
        documents=lazy.documents,
    )
    best = {"round": 0, **held_out.evaluate(model, settings)}
    summary: dict[str, Any] = {"best": best, "num_labels": len(splits.label_map)}
    head = model.head
    if hasattr(head, "head_flops_per_query"):
        summary["moe_head_flops"] = head.head_flops_per_query()
    return summary


def evaluate_lexical(settings: Any) -> dict[str, Any]:
    """The summary of BM25 alone on the held-out queries (a tie with the true document counts
    against it, as for every head: :func:`car_fl.training.train.rank_of_true`)."""
    import torch

    from car_fl.data.splits import load_splits
    from car_fl.heads.lexical import LexicalIndex
    from car_fl.results.run import eval_row
    from car_fl.training.train import rank_metrics
    from car_fl.training.train import rank_of_true as ranks

    splits = load_splits(settings.dataset, seed=settings.seed)
    assert splits.documents is not None
    index = LexicalIndex([d.text for d in splits.documents])

    def metrics(split: Any) -> dict[str, float] | None:
        if not len(split):
            return None
        labels = torch.tensor(split["label"])
        rank = ranks(index.scores(list(split["text"])), labels)
        out = rank_metrics(rank, top_k=settings.eval.top_k)
        if splits.new_documents:
            new = torch.isin(labels, torch.tensor(sorted(splits.new_documents)))
            for name, mask in (("new", new), ("old", ~new)):
                part = rank_metrics(rank[mask], top_k=settings.eval.top_k)
                out.update({f"{name}_{k}": v for k, v in part.items()})
        return out

    test = metrics(splits.test)
    assert test is not None
    best = {"round": 0, **eval_row(metrics(splits.validation), test)}
    return {"best": best, "num_labels": len(splits.label_map)}


def run_variant(
    name: str,
    corpus: Path,
    out: Path,
    extra: list[str] | None = None,
    *,
    federate: bool = False,
) -> dict[str, Any]:
    """One variant's row; ``federate``: run it as a federation (``extra`` sets ``fl.*``)."""
    from car_fl.centralized import run_centralized
    from car_fl.settings.compose import load_settings
    from car_fl.simulation.in_process import run_local

    federated, overrides = VARIANTS[name]
    federated = federated or federate
    folder = out / name
    extra = extra or []
    settings = load_settings(
        [*corpus_overrides(corpus), *overrides, *extra, f"output_dir={folder}"]
    )
    load = os.getloadavg()
    tick = time.perf_counter()
    if name == "bm25":
        summary = evaluate_lexical(settings)
        history: list[dict[str, Any]] = []
    elif name in UNTRAINED and not federated:
        summary = evaluate_untrained(settings)
        history = []
    elif federated:
        metrics = run_local(settings)
        summary = metrics["summary"]
        history = metrics.get("history", [])
    else:
        summary = run_centralized(settings, folder)
        history = []
    seconds = time.perf_counter() - tick
    best = summary["best"]
    row: dict[str, Any] = {
        "name": name,
        "federated": federated,
        "overrides": " ".join([*overrides, *extra]),
    }
    row.update({f"test_{k}": best.get(f"test_{k}") for k in COLUMNS})
    row.update({f"val_{k}": best.get(f"val_{k}") for k in ("recall@10",)})
    for part in ("new", "old"):
        row[f"test_{part}_recall@10"] = best.get(f"test_{part}_recall@10")
    row["selected"] = best.get("round")
    # the starting point (epoch or round 0): what selection could always fall back to
    initial = summary.get("initial") or {}
    row["start_test_recall@10"] = initial.get("test_recall@10")
    row["start_val_recall@10"] = initial.get("val_recall@10")
    row["clients"] = settings.fl.clients if federated else None
    row["feature_seconds"] = summary.get("feature_seconds")
    row["seconds"] = round(seconds, 1)
    row["load_before"] = [round(x, 2) for x in load]
    row["load_after"] = [round(x, 2) for x in os.getloadavg()]
    rounds = [r for r in history if r.get("round", 0) > 0]
    if rounds:
        sent = [r.get("bytes_sent_per_client") for r in rounds if r.get("bytes_sent_per_client")]
        received = [r.get("bytes_received", 0) / max(r.get("clients_ok") or 1, 1) for r in rounds]
        row["bytes_down_per_client_round"] = max(sent) if sent else None
        row["bytes_up_per_client_round"] = round(max(received)) if received else None
        row["epsilon"] = summary.get("epsilon")
    row.update(head_cost(summary, settings) if name != "bm25" else {"head_flops": 0})
    return row


def table(rows: list[dict[str, Any]], command: str) -> str:
    def fmt(value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:.3f}"
        return str(value)

    mips = next((r["test_recall@10"] for r in rows if r["name"] == "mips"), None)
    head = (
        "| variant | FL | R@1 | R@5 | R@10 | Δ R@10 vs MIPS | MRR | nDCG@10 | R@10 new docs "
        "| R@10 old docs | head MACs/query | bytes up/client/round | ε | seconds |"
    )
    lines = [f"`{command}`", "", head, "|" + "---|" * 14]
    for r in rows:
        delta = (r["test_recall@10"] - mips) * 100 if mips is not None else None
        lines.append(
            "| "
            + " | ".join(
                [
                    r["name"],
                    f"{r.get('clients') or 3} clients" if r["federated"] else "–",
                    fmt(r["test_recall@1"]),
                    fmt(r["test_recall@5"]),
                    fmt(r["test_recall@10"]),
                    f"{delta:+.1f}" if delta is not None else "–",
                    fmt(r["test_mrr"]),
                    fmt(r["test_ndcg@10"]),
                    fmt(r["test_new_recall@10"]),
                    fmt(r["test_old_recall@10"]),
                    f"{int(r['head_flops']):,}",
                    fmt(r.get("bytes_up_per_client_round")),
                    fmt(r.get("epsilon")),
                    fmt(r["seconds"]),
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def split_only(only: list[str] | None) -> tuple[list[str] | None, list[str]]:
    """``--only``'s variant names, and the KEY=VALUE overrides that followed them (argparse
    gives ``--only moe moe.eval_route=12`` all to ``--only``)."""
    if only is None:
        return None, []
    return [o for o in only if "=" not in o], [o for o in only if "=" in o]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="folder of arxiv_corpus.py")
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument(
        "--only",
        nargs="*",
        metavar="VARIANT",
        help=f"variants to run ({', '.join(VARIANTS)}); KEY=VALUE overrides may follow them",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="Hydra overrides applied after each variant's (e.g. model=smollm2 "
        "train.epochs=3 train.batch_size=128 dataset.new_fraction=0)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="more Hydra overrides, as with --set"
    )
    parser.add_argument("--clients", type=int, help="run every chosen variant federated")
    parser.add_argument("--rounds", type=int, help="federated rounds (fl.rounds)")
    parser.add_argument(
        "--dp-epsilon",
        type=float,
        help="record-level DP-SGD at this ε per client (δ = 1e-5), federated",
    )
    args = parser.parse_args(argv)
    try:
        fed = federation_overrides(
            clients=args.clients, rounds=args.rounds, epsilon=args.dp_epsilon
        )
    except ValueError as err:
        parser.error(str(err))
    federate = args.clients is not None or args.dp_epsilon is not None
    if (args.rounds is not None or args.dp_epsilon is not None) and args.clients is None:
        parser.error("--rounds and --dp-epsilon need --clients (a federation)")
    names, after_only = split_only(args.only)
    unknown = [name for name in names or [] if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    extra = [*fed, *args.set, *after_only, *args.overrides]
    bad = [o for o in extra if "=" not in o]
    if bad:
        parser.error(f"overrides are KEY=VALUE, got {' '.join(bad)}")
    for name in ("documents.jsonl", "queries.jsonl"):
        if not (args.corpus / name).is_file():
            parser.error(f"{args.corpus / name} not found; build it with scripts/arxiv_corpus.py")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    done = {}
    if results.is_file():  # resume: one line per finished variant
        for line in results.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            done[row["name"]] = row
    for name in names or list(VARIANTS):
        if name in done and names is None:
            continue
        row = run_variant(name, args.corpus, args.out, extra, federate=federate)
        done[name] = row
        print(json.dumps(row), flush=True)
        with results.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in done.values())
    rows = [done[n] for n in VARIANTS if n in done]
    from car_fl.results.rows import write_csv

    write_csv(args.out / "results.csv", rows)
    command = "python " + " ".join(["scripts/retrieval_benchmark.py", *sys.argv[1:]])
    text = table(rows, command)
    (args.out / "table.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

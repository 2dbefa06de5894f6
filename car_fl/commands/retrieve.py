"""``car-fl retrieve``: the top-K labels (a corpus's documents: id, text, score) of queries."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from car_fl.settings.choices import DEVICES

NAME = "retrieve"
HELP = "top-K labels or documents (id, text, score, probability) for queries, from a checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("queries", nargs="*", help="query texts")
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint folder, e.g. runs/<run>/checkpoints/best",
    )
    parser.add_argument("--file", help="text file with one query per line")
    parser.add_argument(
        "-k", type=int, default=None, help="how many labels (default: largest eval K)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="encoder hub id or folder, if not the one the checkpoint was trained with",
    )
    parser.add_argument(
        "--blocks-service",
        default=None,
        help="run the encoder's transformer blocks on this blocks service (car-fl serve-blocks), "
        "e.g. http://127.0.0.1:8200/blocks; this machine keeps its embeddings, norm and head",
    )
    parser.add_argument(
        "--documents",
        default=None,
        help="a corpus's documents file, if not where the checkpoint's settings name it "
        "(it must hold the same documents)",
    )
    parser.add_argument("--device", default=None, choices=DEVICES)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def read_queries(args: argparse.Namespace) -> list[str]:
    queries = list(args.queries)
    if args.file is not None:
        path = Path(args.file)
        if not path.is_file():
            raise FileNotFoundError(f"query file {path} not found")
        queries += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not queries:
        raise ValueError("give queries as arguments or with --file (one per line)")
    return queries


def run(args: argparse.Namespace) -> int:
    """Load a checkpoint and its encoder; print the top-K labels and scores per query."""
    from car_fl.common.hub import offline_unless_reachable

    queries = read_queries(args)
    offline_unless_reachable()  # no Hub: the loaders read the local cache, and fail in seconds
    from car_fl.serving.checkpoint import load_retriever  # torch: only when retrieving

    retriever = load_retriever(
        args.checkpoint,
        device=args.device,
        model=args.model,
        blocks_service=args.blocks_service,
        documents_path=args.documents,
    )
    assert retriever.settings is not None
    k = args.k or max(retriever.settings.eval.top_k)
    results = retriever.retrieve(queries, k)
    if args.json:  # "label" is the document id (kept for label-classification checkpoints)
        # "probability": null for MIPS and kNN (not trained with cross-entropy)
        payload = [
            {
                "query": q,
                "score_kind": r.score_kind,
                "results": [
                    {
                        "label": hit.id,
                        "id": hit.id,
                        "text": hit.text,
                        "score": hit.score,
                        "probability": hit.probability,
                    }
                    for hit in r.hits
                ],
            }
            for q, r in zip(queries, results, strict=True)
        ]
        print(json.dumps(payload, indent=2))
    else:
        for query, res in zip(queries, results, strict=True):
            print(f"{query}\t(scores: {res.score_kind})")
            for rank, hit in enumerate(res.hits, 1):
                text = "" if hit.text == hit.id else f"\t{shorten(hit.text, TEXT_WIDTH)}"
                print(f"  {rank:>2d}. {hit.id}\t{hit.score:.4f}{text}")
    return 0


#: Characters of a document's text printed per hit (``--json`` prints all of it).
TEXT_WIDTH = 100


def shorten(text: str, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"

"""The ``car-fl`` command.

``car-fl retrieve``: top-K labels for queries from a checkpoint.
``car-fl report``: the method's tables and plots from sweep or run directories.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from car_fl.method.serving import load_retriever


def _read_queries(args: argparse.Namespace) -> list[str]:
    queries = list(args.queries)
    if args.file is not None:
        path = Path(args.file)
        if not path.is_file():
            raise SystemExit(f"error: query file {path} not found")
        queries += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not queries:
        raise SystemExit("error: give queries as arguments or with --file (one per line)")
    return queries


def cmd_retrieve(args: argparse.Namespace) -> int:
    """Load a checkpoint and its encoder; print the top-K labels and scores per query."""
    queries = _read_queries(args)
    retriever = load_retriever(args.checkpoint, device=args.device, model=args.model)
    assert retriever.settings is not None
    k = args.k or max(retriever.settings.eval.top_k)
    results = retriever.retrieve(queries, k)
    if args.json:
        payload = [
            {
                "query": q,
                "results": [
                    {"label": label, "score": score}
                    for label, score in zip(r.labels, r.scores, strict=True)
                ],
            }
            for q, r in zip(queries, results, strict=True)
        ]
        print(json.dumps(payload, indent=2))
    else:
        for query, res in zip(queries, results, strict=True):
            print(query)
            for rank, (label, score) in enumerate(zip(res.labels, res.scores, strict=True), 1):
                print(f"  {rank:>2d}. {label}\t{score:.4f}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Tables (Markdown, CSV) and plots from sweep directories or run directories."""
    from car_fl.results.report import write_report

    out = args.out or str(Path(args.paths[0]) / "report")
    try:
        report = write_report(args.paths, out)
    except FileNotFoundError as err:
        print(f"car-fl report: {err}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{n} {status}" for status, n in sorted(report.counts.items()))
    print(f"{len(report.rows)} runs ({counts})")
    for path in (report.markdown, report.results_csv, report.retrieval_csv, *report.plots):
        print(f"  {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="car-fl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ret = sub.add_parser("retrieve", help="top-K labels for queries, from a checkpoint")
    ret.add_argument("queries", nargs="*", help="query texts")
    ret.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint folder, e.g. outputs/<date>/<time>/checkpoints/best",
    )
    ret.add_argument("--file", help="text file with one query per line")
    ret.add_argument("-k", type=int, default=None, help="how many labels (default: largest eval K)")
    ret.add_argument(
        "--model",
        default=None,
        help="encoder hub id or folder, if not the one the checkpoint was trained with",
    )
    ret.add_argument("--device", default=None, choices=["auto", "cpu", "cuda", "mps"])
    ret.add_argument("--json", action="store_true", help="print JSON instead of text")
    ret.set_defaults(func=cmd_retrieve)
    rep = sub.add_parser("report", help="tables and plots from sweep or run directories")
    rep.add_argument("paths", nargs="+", help="sweep directories and/or run directories")
    rep.add_argument("--out", default=None, help="output folder (default: <first path>/report)")
    rep.set_defaults(func=cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

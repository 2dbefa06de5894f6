"""``car-fl report``: the method's tables (Markdown, CSV) and plots across run directories."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "report"
HELP = "tables and plots from sweep or run directories"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", help="sweep directories and/or run directories")
    parser.add_argument("--out", default=None, help="output folder (default: <first path>/report)")


def run(args: argparse.Namespace) -> int:
    """Tables (Markdown, CSV) and plots from sweep directories or run directories."""
    from car_fl.results.report import write_report

    out = args.out or str(Path(args.paths[0]) / "report")
    report = write_report(args.paths, out)  # a missing folder: one line, exit 1
    counts = ", ".join(f"{n} {status}" for status, n in sorted(report.counts.items()))
    print(f"{len(report.rows)} runs ({counts})")
    for path in (report.markdown, report.results_csv, report.retrieval_csv, *report.plots):
        print(f"  {path}")
    return 0

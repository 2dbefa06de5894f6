"""``report.md``: the report's Markdown tables (results, retrieval approaches, failed jobs)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def _fmt(value: Any, kind: str) -> str:
    if value in ("", None):
        return "—"
    if kind == "pct":
        return f"{100 * float(value):.2f}"
    if kind == "float":
        return f"{float(value):.4f}"
    if kind == "sec":
        return f"{float(value):.1f}"
    if kind == "x":
        return f"{float(value):.2f}×"
    if kind == "eps":
        v = float(value)
        return "∞" if math.isinf(v) else f"{v:.4g}"
    return str(value)


RESULT_COLUMNS = [
    ("model", "model", "str"),
    ("approach", "approach", "str"),
    ("clients", "clients", "str"),
    ("scenario", "scenario", "str"),
    ("top1", "final top-1 (%)", "pct"),
    ("selected", "selected on val.", "str"),
    ("val_top1", "its val. top-1 (%)", "pct"),
    ("top1_selected", "its top-1 (%)", "pct"),
    ("topk", "top-K (%)", "pct"),
    ("mrr", "MRR", "float"),
    ("macro_f1", "macro-F1", "float"),
    ("seconds", "train + val (s)", "sec"),
    ("speedup", "speed-up", "x"),
    ("epsilon", "ε", "eps"),
    ("status", "status", "str"),
    ("differs", "differs in", "str"),
    ("source", "source", "str"),
]
RETRIEVAL_COLUMNS = [
    ("model", "model", "str"),
    ("approach", "approach", "str"),
    ("top1", "final top-1 (%)", "pct"),
    ("selected", "selected on val.", "str"),
    ("val_top1", "its val. top-1 (%)", "pct"),
    ("top1_selected", "its top-1 (%)", "pct"),
    ("topk", "top-K (%)", "pct"),
    ("mrr", "MRR", "float"),
    ("macro_f1", "macro-F1", "float"),
    ("seconds", "train + val (s)", "sec"),
    ("status", "status", "str"),
    ("differs", "differs in", "str"),
    ("source", "source", "str"),
]


def markdown_table(rows: Sequence[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """A Markdown table; columns empty in every row (e.g. ε without DP) are left out."""
    columns = [c for c in columns if any(r.get(c[0]) not in ("", None) for r in rows)]
    ks = sorted({r["k"] for r in rows if r.get("k")})
    header = [
        title.replace("top-K", f"top-{ks[0]}") if len(ks) == 1 else title for _, title, _ in columns
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [_fmt(row.get(key), kind) for key, _, kind in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(
    rows: Sequence[dict[str, Any]],
    plots: Sequence[Path],
    *,
    retrieval_rows: Callable[[Sequence[dict[str, Any]]], list[dict[str, Any]]],
) -> str:
    """``report.md``: per dataset the results table and (``retrieval_rows`` of its rows) the
    retrieval approaches table, the jobs without results, the plots."""
    parts = ["# car-fl results", ""]
    for dataset in sorted({r["dataset"] for r in rows}):
        subset = [r for r in rows if r["dataset"] == dataset]
        parts += [f"## {dataset or 'runs without a configuration'}", ""]
        parts += ["### Centralised, FL and FL + DP", "", markdown_table(subset, RESULT_COLUMNS), ""]
        retrieval = retrieval_rows(subset)
        if len({r["approach"] for r in retrieval}) > 1:
            parts += ["### Retrieval approaches (centralised)", ""]
            parts += [markdown_table(retrieval, RETRIEVAL_COLUMNS), ""]
    problems = [r for r in rows if r["status"] != "ok"]
    if problems:
        parts += ["## Jobs without results", ""]
        parts += [
            f"- `{r['job']}` ({r['status']}): {r['reason']} — overrides: `{r['overrides']}`"
            for r in problems
        ]
        parts.append("")
    if plots:
        parts += ["## Curves", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    parts.append(
        "Final: the last epoch's (round's) model on test; selected on val.: the epoch (round) "
        "whose model scored best on validation, with its validation and test top-1. "
        "Speed-up: the centralised run's train + validation time divided by this run's, for "
        "the same sweep, dataset, model and approach. ε: the largest ε any client spent "
        "(δ = dp.delta)."
    )
    return "\n".join(parts) + "\n"

"""Reports across runs: the method's tables and figures from a sweep or any run directories.

``car-fl report SWEEP_DIR [RUN_DIR ...] --out DIR`` (and the end of every sweep) reads each
run's ``config.yaml``, ``metrics.json`` and ``job.json``, and writes ``results.csv`` and
``report.md`` (one row per job, failed and skipped ones with the reason), ``retrieval.csv``
(the centralised runs' retrieval approaches), and ``curves-*.png`` / ``retrieval-*.png``
(test loss and top-1 against epochs, one line per scenario or approach).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from car_fl.common.io import atomic_write_text
from car_fl.results.plots import plot_against_epochs
from car_fl.results.report_markdown import markdown_report
from car_fl.results.rows import METRICS_JSON, MetricsFile, RoundRow, RunSummary, write_csv
from car_fl.settings.compose import settings_from_yaml
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.schema import APPROACHES, Settings

log = logging.getLogger(__name__)

JOB_JSON = "job.json"
CONFIG_YAML = "config.yaml"

SCENARIOS = ("centralised", *(spec.report_name for spec in MODES.values()))


def approach_of(settings: Settings) -> str:
    """The retrieval approach of a run, as the method's MIPS comparison names it."""
    if settings.head.kind.traits.memory:  # how many remembered examples vote
        return f"{settings.approach_label} (k={settings.head.knn_k})"
    return settings.approach_label


def scenario_of(settings: Settings, clients: int) -> str:
    if clients == 1:
        return "centralised" + (f" + DP ({settings.dp.mode})" if settings.dp.enabled else "")
    return MODES[settings.dp.mode].report_name


@dataclass
class RunRecord:
    """One run (or sweep job) as read back from its directory."""

    path: Path
    status: str  # ok, failed, skipped, incomplete
    reason: str = ""
    overrides: list[str] = field(default_factory=list)
    settings: Settings | None = None
    summary: RunSummary | None = None
    history: list[RoundRow] = field(default_factory=list)
    clients: int | None = None

    @classmethod
    def read(cls, path: Path) -> RunRecord:
        job = _read_json(path / JOB_JSON) or {}
        metrics = None
        if (path / METRICS_JSON).is_file():
            try:
                metrics = MetricsFile.read(path)
            except ValueError as err:
                log.warning("%s", err)
        settings = None
        if (path / CONFIG_YAML).is_file():
            settings = settings_from_yaml((path / CONFIG_YAML).read_text(encoding="utf-8"))
        summary = metrics.summary if metrics is not None else None
        status = job.get("status") or ("ok" if summary else "incomplete")
        if status == "ok" and (summary is None or summary.complete is False):
            status = "incomplete"
        clients = job.get("clients", summary.clients if summary is not None else None)
        return cls(
            path=path,
            status=status,
            reason=job.get("reason", "") or ("" if status == "ok" else "no complete metrics.json"),
            overrides=list(job.get("overrides", [])),
            settings=settings,
            summary=summary,
            history=metrics.history if metrics is not None else [],
            clients=int(clients) if clients is not None else None,
        )

    @property
    def final(self) -> dict[str, Any]:
        """The final row's columns (empty without a summary)."""
        final = self.summary.final if self.summary is not None else None
        return final.to_dict() if final is not None else {}

    @property
    def best(self) -> dict[str, Any]:
        """The columns of the row validation selected (empty without a summary)."""
        best = self.summary.best if self.summary is not None else None
        return best.to_dict() if best is not None else {}

    def row(self) -> dict[str, Any]:
        """The run's line in ``results.csv`` (full precision; empty where not applicable)."""
        s, summary = self.settings, self.summary
        final, best = self.final, self.best
        num_labels = summary.num_labels if summary is not None else None
        k = informative_k(s, final, num_labels) if s is not None else None
        dp = s.dp.mode if s is not None else ""
        epsilon = summary.epsilon if summary is not None else None
        return {
            "job": self.path.name,
            "status": self.status,
            "dataset": s.dataset.label if s else "",
            "model": s.model.name if s else "",
            "approach": approach_of(s) if s else "",
            "clients": self.clients if self.clients is not None else "",
            "scenario": scenario_of(s, self.clients) if s and self.clients else "",
            "epochs": final.get("epochs", ""),
            "top1": final.get("test_top1", ""),
            "selected": best.get("round", ""),
            "val_top1": best.get("val_top1", ""),
            "top1_selected": best.get("test_top1", ""),
            "k": k or "",
            "topk": final.get(f"test_top{k}", "") if k else "",
            "mrr": final.get("test_mrr", ""),
            "macro_f1": final.get("test_macro_f1", ""),
            "seconds": summary.total_seconds if summary is not None else "",
            "speedup": "",
            "epsilon": epsilon if dp not in ("", "none") and epsilon is not None else "",
            "reason": self.reason,
            "overrides": " ".join(self.overrides),
            "path": str(self.path),
            "source": source_of(self.path),
            "differs": "",
        }


def informative_k(settings: Settings, final: dict[str, Any], num_labels: int | None) -> int | None:
    """The largest reported K below the number of labels (top-K of all labels is always 1)."""
    ks = [k for k in settings.eval.top_k if k > 1 and f"test_top{k}" in final]
    num_labels = num_labels or len(settings.dataset.label_texts) or None
    below = [k for k in ks if num_labels is None or k < num_labels]
    return max(below) if below else None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


def find_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Run directories under ``paths`` (itself, or two levels down): those holding
    ``job.json`` or ``metrics.json``, numbered jobs in numeric order."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a directory of runs or a run directory")
        if _is_run(path):
            found.append(path)
            continue
        children = sorted((p for p in path.iterdir() if p.is_dir()), key=_natural)
        for child in children:
            if _is_run(child):
                found.append(child)
            else:
                found.extend(
                    g for g in sorted(child.iterdir(), key=_natural) if g.is_dir() and _is_run(g)
                )
    return found


def _is_run(path: Path) -> bool:
    return (path / JOB_JSON).is_file() or (path / METRICS_JSON).is_file()


def _natural(path: Path) -> tuple[int, str]:
    head = path.name.split("-")[0].split("_")[0]
    return (int(head), path.name) if head.isdigit() else (1 << 30, path.name)


def collect_runs(paths: Sequence[str | Path]) -> list[RunRecord]:
    runs = [RunRecord.read(p) for p in find_run_dirs(paths)]
    if not runs:
        where = ", ".join(map(str, paths))
        raise FileNotFoundError(f"no runs (folders with {JOB_JSON} or {METRICS_JSON}) in {where}")
    return runs


def source_of(path: Path) -> str:
    """Where a row came from, short: a sweep member as ``sweep/job``, a run as its folder."""
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


#: Settings that differ between any two runs and say nothing about what was run.
NOT_DIFFERENCES = ("output_dir", "cache_dir", "resume", "progress")


def differences(runs: Sequence[RunRecord]) -> dict[Path, str]:
    """For runs whose rows would otherwise look the same (one dataset, model, approach,
    clients and scenario), the settings in which each differs from the others."""
    from car_fl.settings.flat import flat_settings

    groups: dict[tuple[Any, ...], list[RunRecord]] = defaultdict(list)
    for run in runs:
        if run.settings is not None:
            s = run.settings
            key = (s.dataset.label, s.model.name, approach_of(s), run.clients)
            groups[(*key, scenario_of(s, run.clients or 1))].append(run)
    out: dict[Path, str] = {}
    for group in groups.values():
        if len(group) < 2:
            continue
        flat = [flat_settings(r.settings) for r in group if r.settings is not None]
        keys = sorted(
            k
            for k in set().union(*flat)
            if not k.startswith(NOT_DIFFERENCES) and len({repr(f.get(k)) for f in flat}) > 1
        )
        for run, values in zip(group, flat, strict=True):
            out[run.path] = " ".join(f"{k}={values.get(k)}" for k in keys)
    return out


# --------------------------------------------------------------------------------- tables
def results_rows(runs: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """One row per run, with the speed-up against the matching centralised run, where it
    came from and what sets it apart from rows that would otherwise look the same."""
    rows = [r.row() for r in runs]
    differ = differences(runs)
    for run, row in zip(runs, rows, strict=True):
        row["differs"] = differ.get(run.path, "")
    reference: dict[tuple[Any, ...], float] = {}
    for row in rows:
        if row["status"] == "ok" and row["clients"] == 1 and row["seconds"]:
            reference.setdefault(_group(row), float(row["seconds"]))
    for row in rows:
        ref = reference.get(_group(row))
        if row["status"] == "ok" and ref and row["seconds"]:
            row["speedup"] = ref / float(row["seconds"])
    order = {s: i for i, s in enumerate(SCENARIOS)}
    rows.sort(
        key=lambda r: (
            r["dataset"],
            r["model"],
            _approach_rank(r["approach"]),
            order.get(r["scenario"], len(order)),
            r["clients"] if isinstance(r["clients"], int) else 1 << 30,
        )
    )
    return rows


def _group(row: dict[str, Any]) -> tuple[Any, ...]:
    """Runs comparable for the speed-up: same sweep (folder), dataset, model and approach."""
    return (str(Path(row["path"]).parent), row["dataset"], row["model"], row["approach"])


def _approach_rank(approach: str) -> tuple[int, str]:
    """The method's order: MIPS, adapter + MIPS, classifier, adapter + classifier, kNN."""
    order = {spec.label: i for i, (_, spec) in enumerate(APPROACHES.values())}
    return order.get(approach.split(" (k=")[0], len(order)), approach


def retrieval_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The centralised runs: one row per retrieval approach (MIPS comparison)."""
    chosen = [r for r in rows if r["scenario"] == "centralised"]
    return sorted(chosen, key=lambda r: (r["dataset"], r["model"], _approach_rank(r["approach"])))


# ---------------------------------------------------------------------------------- plots
def _slug(*parts: str) -> str:
    text = "".join(c if c.isalnum() else "-" for c in "-".join(parts).lower())
    return "-".join(filter(None, text.split("-")))


def plot_runs(out: Path, runs: Sequence[RunRecord]) -> list[Path]:
    """``curves-*.png`` per (dataset, model, approach) and ``retrieval-*.png`` per model."""
    ok = [r for r in runs if r.status == "ok" and r.settings is not None and r.history]
    by_approach: dict[tuple[str, str, str], list[RunRecord]] = defaultdict(list)
    by_model: dict[tuple[str, str], list[RunRecord]] = defaultdict(list)
    for run in ok:
        assert run.settings is not None
        key = (run.settings.dataset.label, run.settings.model.name)
        by_approach[(*key, approach_of(run.settings))].append(run)
        if run.clients == 1:
            by_model[key].append(run)
    paths: list[Path] = []
    for (dataset, model, approach), group in sorted(by_approach.items()):
        trained = [r for r in group if any(h.epochs for h in r.history)]
        if not trained:
            continue
        differ = differences(trained)
        lines = {  # one line per run: runs of one scenario told apart by what differs
            f"{scenario_of(r.settings, r.clients or 1)}, {r.clients} client"
            + ("s" if (r.clients or 1) > 1 else "")
            + (f" ({differ[r.path]})" if differ.get(r.path) else ""): r.history
            for r in trained
            if r.settings is not None
        }
        path = out / f"curves-{_slug(dataset, model, approach)}.png"
        plot_against_epochs(path, lines, title=f"{dataset}, {model}, {approach}")
        paths.append(path)
    for (dataset, model), group in sorted(by_model.items()):
        if len({approach_of(r.settings) for r in group if r.settings}) < 2:
            continue
        differ = differences(group)
        lines = {
            approach_of(r.settings) + (f" ({differ[r.path]})" if differ.get(r.path) else ""): (
                r.history
            )
            for r in group
            if r.settings is not None
        }
        path = out / f"retrieval-{_slug(dataset, model)}.png"
        plot_against_epochs(
            path, lines, title=f"{dataset}, {model}: retrieval approaches (centralised)"
        )
        paths.append(path)
    return paths


# --------------------------------------------------------------------------------- report
@dataclass
class Report:
    rows: list[dict[str, Any]]
    markdown: Path
    results_csv: Path
    retrieval_csv: Path
    plots: list[Path]

    @property
    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for row in self.rows:
            counts[row["status"]] += 1
        return dict(counts)


def write_report(paths: Iterable[str | Path], out: str | Path) -> Report:
    """Collect the runs under ``paths`` and write tables and plots into ``out``."""
    paths = list(paths)
    runs = collect_runs(paths)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = results_rows(runs)
    plots = plot_runs(out, runs)
    results_csv, retrieval_csv = out / "results.csv", out / "retrieval.csv"
    write_csv(results_csv, rows)
    write_csv(retrieval_csv, retrieval_rows(rows))
    markdown = out / "report.md"
    atomic_write_text(markdown, markdown_report(rows, plots, retrieval_rows=retrieval_rows))
    report = Report(rows, markdown, results_csv, retrieval_csv, plots)
    log.info("report of %d runs %s: %s", len(rows), report.counts, markdown)
    return report

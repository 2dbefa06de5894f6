"""One run, whatever drives it: its folder, rows, selection, patience, checkpoints, resume, end.

The centralised epochs, the federation's rounds and the linear probe (a run in memory) each
drive a :class:`Run`; nothing else selects, counts patience, checkpoints or resumes
(docs/architecture.md, "What every run shares"). Each step's checkpoint (with its
optimiser's state) is written before its row, so a stopped run resumes and ends where an
uninterrupted one would.

Checkpoints: adapter + head weights (safetensors), label map, resolved config, round, metrics.
``weights.safetensors`` holds only trainable tensors (never the encoder), with all the metadata
in its header, so one file explains the run; ``meta.json`` repeats the metadata for people.

Model selection is on the validation split, never on test (:func:`is_better`): higher
validation top-1 wins, then lower validation loss, then the earlier row. Without a validation
split the latest model is "best" (it equals "final").
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from car_fl.common.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from car_fl.data.labels import LabelMap
from car_fl.results.plots import plot_curves
from car_fl.results.rows import (
    CLIENTS_CSV,
    METRICS_JSON,
    ClientRow,
    MetricsFile,
    RoundRow,
    RunSummary,
)
from car_fl.settings.compose import (
    NODE_LOCAL_KEYS,
    fingerprint,
    settings_from_yaml,
    settings_to_yaml,
)
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.flat import changed_keys, refuse_other_settings
from car_fl.settings.schema import Settings, federated_part

WEIGHTS = "weights.safetensors"
META = "meta.json"
FORMAT = "car-fl-checkpoint-v1"


@dataclass
class Checkpoint:
    """What a checkpoint folder holds."""

    state: dict[str, torch.Tensor]
    label_map: LabelMap
    settings: Settings
    round: int
    metrics: dict[str, Any] = field(default_factory=dict)
    epsilon: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(folder: str | Path, ckpt: Checkpoint) -> Path:
    """Write the checkpoint atomically (a crash leaves the previous one whole); the folder."""
    folder = Path(folder)
    state = {k: v.detach().cpu().contiguous() for k, v in ckpt.state.items()}
    meta = {
        "format": FORMAT,
        "round": ckpt.round,
        "mode": ckpt.settings.train.mode,
        "labels": ckpt.label_map.to_list(),
        "metrics": ckpt.metrics,
        "epsilon": ckpt.epsilon,
        "tensors": {k: list(v.shape) for k, v in state.items()},
        "extra": ckpt.extra,
        "config_yaml": settings_to_yaml(ckpt.settings),
    }
    header = {"format": FORMAT, "meta": json.dumps(meta)}
    # bytes, not save_file: safetensors' own temporary file would outlive a killed writer
    atomic_write_bytes(folder / WEIGHTS, save(state, metadata=header))
    atomic_write_json(folder / META, meta)
    return folder


def load_checkpoint(folder: str | Path) -> Checkpoint:
    """Read a checkpoint folder (``FileNotFoundError`` if missing, ``ValueError`` if foreign)."""
    folder = Path(folder)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(
            f"{folder} is not a car-fl checkpoint: {WEIGHTS} is missing (expected a folder "
            "written by a car-fl run, e.g. <run dir>/checkpoints/final)"
        )
    try:
        with safe_open(str(weights), framework="pt") as handle:
            header = handle.metadata() or {}
    except SafetensorError as err:  # cut short by a stop, or not safetensors at all
        raise ValueError(f"{weights}: not a readable safetensors file ({err})") from err
    if header.get("format") != FORMAT or "meta" not in header:
        raise ValueError(f"{weights}: not a car-fl checkpoint (format {header.get('format')!r})")
    meta = json.loads(header["meta"])
    return Checkpoint(
        state=load_file(str(weights)),
        label_map=LabelMap(tuple(meta["labels"])),
        settings=settings_from_yaml(meta["config_yaml"]),
        round=int(meta["round"]),
        metrics=meta.get("metrics", {}),
        epsilon=meta.get("epsilon"),
        extra=meta.get("extra", {}),
    )


Row = Mapping[str, Any]
T = TypeVar("T")


def _as_scores(row: Any) -> Row:
    return row


def eval_row(validation: Mapping[str, float] | None, test: Mapping[str, float]) -> dict[str, float]:
    """Validation and test metrics side by side: ``val_top1``, ..., ``test_top1``, ..."""
    row = {f"val_{k}": float(v) for k, v in (validation or {}).items()}
    row.update({f"test_{k}": float(v) for k, v in test.items()})
    return row


def is_better(row: Row, best: Row | None) -> bool:
    """Whether ``row`` should replace ``best`` as the selected model."""
    if best is None or "val_top1" not in row or "val_top1" not in best:
        return True
    return (row["val_top1"], -row["val_loss"]) > (best["val_top1"], -best["val_loss"])


def select_best(rows: Iterable[T], *, scores: Callable[[T], Row] = _as_scores) -> T | None:
    """The row :func:`is_better` keeps when the rows arrive in order (``scores``: a row's
    ``val_*`` metrics; default: the row is a mapping of them)."""
    best: T | None = None
    for row in rows:
        if is_better(scores(row), scores(best) if best is not None else None):
            best = row
    return best


def patience_spent(since_best: int, patience: int | None) -> bool:
    """The one patience rule (``train.patience``; null: never): ``since_best`` epochs or rounds
    that count were recorded after the one validation selects."""
    return patience is not None and since_best >= patience


log = logging.getLogger(__name__)

#: Seconds between two drawings of a running run's ``curves.png`` (its end always draws it).
PLOT_SECONDS = 30.0
#: The optimiser's state beside a step's weights (a run whose steps keep one optimiser).
OPTIMIZER = "optimizer.safetensors"


@dataclass(frozen=True)
class Kind:
    """What differs between the kinds of run: names, the step's setting, what a resume may
    change."""

    name: str
    unit: str
    steps_key: str
    described: str
    may_change: tuple[str, ...]

    def steps(self, settings: Settings) -> int:
        """The steps the run plans (its ``steps_key``)."""
        section, key = self.steps_key.split(".")
        return int(getattr(getattr(settings, section), key))

    def comparable(self, saved: Settings) -> Settings:
        """A saved run's settings as a resume compares them (a federation's, its own part)."""
        return federated_part(saved) if self.name == "federated" else saved


CENTRALIZED = Kind(
    "centralized",
    "epoch",
    "train.epochs",
    "a centralised run (car-fl train)",
    ("output_dir", "cache_dir", "resume", "progress", "device", "train.epochs"),
)
FEDERATED = Kind(
    "federated",
    "round",
    "fl.rounds",
    "a federation (car-fl run / flwr run ., or car-fl train dp=record)",
    # each node's own paths and devices, but not the server's encoder: the rows so far are its
    (*(k for k in NODE_LOCAL_KEYS if k != "model.name_or_path"), "fl.rounds", "train.epochs"),
)
KINDS = {kind.name: kind for kind in (CENTRALIZED, FEDERATED)}


def round_line(row: RoundRow, *, unit: str = "round") -> str:
    """The fixed-format log line of one round (or epoch)."""
    m = row.metrics
    val = f"val loss {m['val_loss']:.4f} top1 {m['val_top1']:.4f} | " if "val_top1" in m else ""
    train_loss = row.train_loss if row.train_loss is not None else float("nan")
    train_acc = row.train_accuracy if row.train_accuracy is not None else float("nan")
    test = (
        f"test loss {m['test_loss']:.4f} top1 {m['test_top1']:.4f}"
        if math.isfinite(m.get("test_top1", math.nan))
        else "test at the end"  # eval.test_every_round=false: the selected and final state
    )
    return (
        f"{unit} {row.round:>3d} | train loss {train_loss:.4f} acc {train_acc:.4f} | {val}"
        f"{test} | {row.seconds:.1f}s | "
        f"sent {row.bytes_sent:,} B recv {row.bytes_received:,} B"
        + (f" | ε {row.epsilon:.4g}" if row.dp_active else "")
    )


def brief(metrics: dict[str, float]) -> str:
    """``val``/``test`` loss and top-1 of a row's metrics, those that were evaluated."""
    parts = [
        f"{split} loss {metrics[f'{split}_loss']:.4f} top1 {metrics[f'{split}_top1']:.4f}"
        for split in ("val", "test")
        if math.isfinite(metrics.get(f"{split}_top1", math.nan))
    ]
    return ", ".join(parts) or "not evaluated"


def default_output_dir(settings: Settings) -> Path:
    """``runs/<date>-<time>-<data>-<model>-<mode>``: where a run writes without ``output_dir``."""
    data = settings.dataset.label.rsplit(".", 1)[0]  # synthetic.tsv -> synthetic
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{data}-{settings.model.name}-{settings.train.mode}"
    return Path("runs") / re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


@dataclass
class ResumePoint:
    """Where a stopped run goes on: after step ``done``, from its ``checkpoint`` (and its
    ``optimizer`` state, if it kept one), with the rows and files the run had written."""

    done: int
    checkpoint: Checkpoint
    history: list[RoundRow]
    summary: RunSummary
    client_rows: list[ClientRow]
    optimizer: dict[str, torch.Tensor] | None
    #: Every planned step is done (or the patience ran out) but the end was not written.
    finished: bool

    @property
    def initial(self) -> dict[str, float]:
        """The starting point's metrics (step 0)."""
        return self.summary.initial or {}


def check_run_dir(run_dir: Path, kind: Kind) -> None:
    """Refuse, in seconds and before any other work, a folder that is not a run of ``kind``."""
    for name in ("config.yaml", METRICS_JSON):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(
                f"resume={run_dir}: {name} is missing; resume= takes the folder of "
                f"{kind.described} that has run at least one step"
            )
    try:
        saved = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8")).get("kind")
    except (ValueError, AttributeError) as err:  # not JSON, or not a run's object
        raise ValueError(
            f"resume={run_dir}: {METRICS_JSON} is not a car-fl run's ({err}); resume= takes "
            f"the folder of {kind.described}"
        ) from None
    if saved not in KINDS:
        raise ValueError(
            f"resume={run_dir}: its {METRICS_JSON} names no kind of car-fl run (kind: "
            f"{saved!r}); resume= takes the folder of {kind.described}"
        )
    if saved != kind.name:
        other = KINDS[saved].described
        raise ValueError(
            f"resume={run_dir}: that is {other}, and this is {kind.described}; resume it the "
            "way it was started"
        )


def open_run_dir(
    settings: Settings, kind: Kind, output_dir: str | Path | None = None
) -> tuple[Path, ResumePoint | None]:
    """The run's folder (the resumed run's, ``output_dir``, ``settings.output_dir`` or
    :func:`default_output_dir`) and the point to resume from; a new run's ``config.yaml``
    is written here, a resumed run's by :meth:`Run.begin`."""
    resume_dir = Path(settings.resume).resolve() if settings.resume else None
    point = load_resume_point(resume_dir, settings, kind) if resume_dir is not None else None
    out = resume_dir or Path(output_dir or settings.output_dir or default_output_dir(settings))
    out = out.resolve()
    log.debug("resolved configuration:\n%s", settings_to_yaml(settings))
    if point is None:
        refuse_another_run(out, settings)
        write_config(settings, out)
    log.info("results: %s", out)
    return out, point


def refuse_another_run(out: Path, settings: Settings) -> None:
    """Refuse a new run into a folder that holds a run of other settings: it would replace
    that run's results and leave its checkpoints beside its own. The same settings run again."""
    if not (out / METRICS_JSON).is_file():
        return
    try:
        saved = settings_from_yaml((out / "config.yaml").read_text("utf-8"))
        changed = changed_keys(saved, settings, ignore=("progress",))
    except (OSError, ValueError) as err:
        changed = [f"its config.yaml does not read: {err}"]
    if changed:
        raise FileExistsError(
            f"{out} holds a run of other settings ({', '.join(changed[:4])}); continue that "
            f"run with resume={out}, or give this one another output_dir"
        )
    log.warning("%s holds a run of the same settings: it runs again from the start", out)


def write_config(settings: Settings, out: Path) -> None:
    """``out/config.yaml``: the resolved settings, the one writer of a run folder's config."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.yaml", settings_to_yaml(settings))
    log.info(
        "resolved configuration (fingerprint %s): %s", fingerprint(settings), out / "config.yaml"
    )


def load_resume_point(run_dir: Path, settings: Settings, kind: Kind) -> ResumePoint:
    """The newest step of the ``kind`` run in ``run_dir`` whose checkpoint loads, to go on
    with ``settings``; refused, saying what to do, when it cannot go on."""
    check_run_dir(run_dir, kind)
    try:
        saved = kind.comparable(settings_from_yaml((run_dir / "config.yaml").read_text("utf-8")))
    except ValueError as err:
        raise ValueError(
            f"resume={run_dir}: its config.yaml does not read as car-fl settings ({err}); it "
            "was changed by hand or cut short: start a new run"
        ) from None
    fix = f"resume it with the same overrides (only {kind.steps_key} may change)"
    refuse_other_settings(run_dir, saved, settings, may_change=kind.may_change, fix=fix)
    metrics = MetricsFile.read(run_dir)
    summary, unit, steps = metrics.summary, kind.unit, kind.steps(settings)
    if summary.stopped_early is not None:
        raise ValueError(
            f"resume={run_dir}: that run ended after {unit} {summary.stopped_early}, when "
            f"train.patience={settings.train.patience} {unit}s had not improved on validation: "
            "it finished, it was not interrupted; to train longer start a new run (a larger "
            "train.patience)"
        )
    # only the two newest steps keep their optimiser: an older one would resume with a fresh one
    keeps_optimizer = any((run_dir / "checkpoints").glob(f"round-*/{OPTIMIZER}"))
    skipped: list[str] = []
    for row in reversed(metrics.history):
        folder = run_dir / "checkpoints" / f"round-{row.round:03d}"
        try:
            checkpoint = load_checkpoint(folder)
            optimizer = load_optimizer(folder, checkpoint.round)
        except (OSError, ValueError, SafetensorError) as err:
            log.warning("resume: skipping %s (%s)", folder.name, err)
            skipped.append(f"{folder.name} ({err})")
            continue
        if optimizer is None and keeps_optimizer:
            raise ValueError(
                f"resume={run_dir}: {'; '.join(skipped)} does not load, and {folder.name} "
                "before it keeps no optimiser state (only the two newest steps do): going on "
                "from it would not be the same run; start it again"
            )
        done = checkpoint.round
        history = [row for row in metrics.history if row.round <= done]
        if [row.round for row in history] != list(range(1, done + 1)):
            raise ValueError(
                f"resume={run_dir}: metrics.json does not hold {unit}s 1 to {done} of "
                f"{folder.name}; it was changed by hand, or is another run's; start a new run"
            )
        if done > steps:
            raise ValueError(
                f"resume={run_dir}: the run already has {done} {unit}s, more than "
                f"{kind.steps_key}={steps}; resume it with {kind.steps_key} of {done} or more"
            )
        if done == steps and summary.complete:
            raise ValueError(
                f"resume={run_dir}: the run already has {done} {unit}s; raise "
                f"{kind.steps_key} above it"
            )
        client_rows = read_client_rows(run_dir, kind, settings)
        return ResumePoint(
            done=done,
            checkpoint=checkpoint,
            history=history,
            summary=summary,
            client_rows=[row for row in client_rows if row.round <= done],
            optimizer=optimizer,
            finished=done >= steps,
        )
    raise ValueError(
        f"resume={run_dir}: no complete {unit} checkpoint to continue from: the run was "
        f"stopped before its first {unit} ended; start it again"
    )


def read_client_rows(run_dir: Path, kind: Kind, settings: Settings) -> list[ClientRow]:
    """A federation's ``clients.csv`` (a centralised run has none); under DP its resume needs
    it: the server's ε counts every reply it saw before."""
    clients, private = run_dir / CLIENTS_CSV, MODES[settings.dp.mode].enabled
    if kind.name != FEDERATED.name or not (private or clients.exists()):
        return []
    try:
        return ClientRow.read_csv(clients)
    except (OSError, csv.Error, ValueError, TypeError) as err:
        why = (
            "the server's ε would lose the replies it saw before, so the run cannot go on"
            if private
            else "it was changed by hand"
        )
        raise ValueError(
            f"resume={run_dir}: {CLIENTS_CSV} does not read ({type(err).__name__}: {err}); "
            f"{why}: start a new run"
        ) from err


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimiser's per-parameter state as flat tensors (``"<parameter>.<name>"``);
    its hyper-parameters are the run's settings and are not kept."""
    out: dict[str, torch.Tensor] = {}
    for index, values in optimizer.state_dict()["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                out[f"{index}.{name}"] = value.detach().cpu().contiguous()
            elif value is not None:
                raise TypeError(f"optimizer state {index}.{name} is not a tensor: {value!r}")
    return out


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """Restore :func:`optimizer_tensors` into ``optimizer`` (built over the same parameters);
    ``ValueError`` if they belong to other parameters."""
    content = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, _, name = key.partition(".")
        if not index.isdigit() or int(index) >= len(params):
            raise ValueError(f"optimizer state {key!r} is for a parameter this model lacks")
        param = params[int(index)]
        if value.dim() and value.shape != param.shape:
            raise ValueError(
                f"optimizer state {key!r} has shape {tuple(value.shape)}, its parameter "
                f"{tuple(param.shape)}"
            )
        state.setdefault(int(index), {})[name] = value
    content["state"] = state
    optimizer.load_state_dict(content)


def load_optimizer(folder: Path, step: int) -> dict[str, torch.Tensor] | None:
    """The optimiser's state kept beside step ``step``'s weights (None: the run keeps none)."""
    path = folder / OPTIMIZER
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as handle:
        if (handle.metadata() or {}).get("step") != str(step):
            raise ValueError(f"{path.name} is not step {step}'s")
    return load_file(str(path))


@dataclass
class Run:
    """Rows, selection, patience, checkpoints, resume, files and end of one run.

    ``output_dir`` None: a run in memory (the linear probe): selection and patience only.
    """

    settings: Settings
    kind: Kind
    output_dir: Path | None
    label_map: LabelMap
    #: The plot's title.
    title: str = ""
    #: What the summary says of the run beyond its rows (clients, data, selection, ...).
    describe: Callable[[], RunSummary] | None = None
    #: Whether a row spends the patience (default: one that trained, not skipped).
    counts: Callable[[RoundRow], bool] = lambda row: not row.skipped
    #: What every checkpoint also records (a corpus's digest, a mixture of experts' layout).
    extra: dict[str, Any] = field(default_factory=dict)
    history: list[RoundRow] = field(default_factory=list)
    best: RoundRow | None = None
    #: The starting point (step 0), a candidate for ``best`` but not part of :attr:`history`.
    initial: RoundRow | None = None
    #: A federation's rows per client and round (``clients.csv``); None: not written.
    client_rows: list[ClientRow] | None = None
    #: The step after which :attr:`patience` ended the run (None: it has not).
    stopped_early: int | None = None
    started: float = field(default_factory=time.perf_counter)
    best_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    plotted_at: float | None = field(default=None, repr=False)

    @property
    def unit(self) -> str:
        return self.kind.unit

    @property
    def checkpoints(self) -> Path:
        assert self.output_dir is not None, "a run in memory keeps no checkpoints"
        return self.output_dir / "checkpoints"

    @property
    def patience(self) -> int | None:
        return self.settings.train.patience

    def begin(self, point: ResumePoint | None, *, data: dict[str, int]) -> None:
        """Continue after ``point`` (None: a new run) once this run's ``data`` (split sizes),
        labels and :attr:`extra` are found to be the saved run's; rewrite its config."""
        if point is None:
            return
        assert self.output_dir is not None
        if "splits_digest" not in point.summary.data:  # a run saved before the digest
            data = {k: v for k, v in data.items() if k != "splits_digest"}
        for what, before, now in (
            ("the labels", point.checkpoint.label_map.to_list(), self.label_map.to_list()),
            ("the data splits", point.summary.data, data),
        ):
            if json.dumps(before, sort_keys=True) != json.dumps(now, sort_keys=True):
                raise ValueError(
                    f"resume={self.output_dir}: {what} differ from that run's; point "
                    "dataset.path (and dataset.documents_path) at the files it was trained on "
                    "(the same lines in another order split otherwise)"
                )
        then = point.checkpoint.extra  # a key on one side only was not recorded on the other
        changed = [k for k in sorted(then.keys() & self.extra.keys()) if then[k] != self.extra[k]]
        if changed:
            values = "; ".join(
                f"{then[k][:20]!r} then, {self.extra[k][:20]!r} now" for k in changed
            )
            raise ValueError(
                f"resume={self.output_dir}: its {', '.join(changed)} differ from that run's "
                f"({values}): the documents, experts or encoder files it was trained with "
                "changed; point dataset.documents_path and model.name_or_path at those, or "
                "start a new run"
            )
        write_config(self.settings, self.output_dir)
        self.history = point.history
        saved = point.summary.best
        self.initial = (  # the saved row when the start was selected: its seconds too
            saved
            if saved is not None and saved.round == 0
            else RoundRow(round=0, epochs=0, metrics=point.initial, seconds=0.0)
        )
        self.best = select_best(
            [self.initial, *self.history] if point.initial else self.history,
            scores=lambda row: row.metrics,
        )
        if self.client_rows is not None:
            self.client_rows = point.client_rows
        self.started -= point.summary.total_seconds
        log.info(
            "resumed %s after %s %d of %d", self.output_dir, self.unit, point.done,
            self.kind.steps(self.settings),
        )  # fmt: skip

    def start(self, row: RoundRow, state: dict[str, torch.Tensor], **meta: Any) -> None:
        """The starting point ``row`` (step 0) of the model ``state``: logged, the first
        candidate for ``best``, kept as :attr:`initial`."""
        if self.history or self.initial is not None:
            raise RuntimeError("the starting point is recorded once, before any other row")
        self.initial = row
        if self.output_dir is not None:
            log.info("%s | starting point", round_line(row, unit=self.unit))
        self._consider(row, state, **meta)

    def record(
        self,
        row: RoundRow,
        state: dict[str, torch.Tensor],
        *,
        epsilon: float | None = None,
        note: str = "",
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """Add step ``row`` of the model ``state``: log it, checkpoint it (with the
        ``optimizer``'s state), keep it as best if it is, rewrite the metrics files."""
        self.history.append(row)
        if self.output_dir is None:
            self._consider(row, state)
            return
        log.info("%s%s", round_line(row, unit=self.unit), note)
        folder = self.checkpoints / f"round-{row.round:03d}"
        if optimizer is not None:  # before the weights: weights that load have their optimiser
            data = save(optimizer_tensors(optimizer), metadata={"step": str(row.round)})
            atomic_write_bytes(folder / OPTIMIZER, data)
        save_checkpoint(folder, self.checkpoint(state, row, epsilon=epsilon))
        self._consider(row, state, epsilon=epsilon)
        self.write(complete=False)
        for old in self.checkpoints.glob(f"round-*/{OPTIMIZER}"):  # once the row is written:
            if int(old.parent.name.removeprefix("round-")) < row.round - 1:  # the two newest
                old.unlink(missing_ok=True)  # stay, should the newest weights not load

    def _consider(
        self, row: RoundRow, state: dict[str, torch.Tensor], *, epsilon: float | None = None
    ) -> None:
        """Keep ``row`` as :attr:`best` if validation prefers it (never test)."""
        if not is_better(row.metrics, self.best.metrics if self.best is not None else None):
            return
        self.best, self.best_state = row, state
        if self.output_dir is not None:
            save_checkpoint(self.checkpoints / "best", self.checkpoint(state, row, epsilon=epsilon))

    def since_best(self) -> int | None:
        """The rows after :attr:`best` that spend the patience; None before any best."""
        if self.best is None:
            return None
        best = self.best.round
        return sum(1 for row in self.history if row.round > best and self.counts(row))

    def stalled(self, *, ahead: int = 0) -> int | None:
        """The step validation selects, once :func:`~car_fl.results.run.patience_spent`
        (with ``ahead`` more rows); None before."""
        since = self.since_best()
        if since is None or self.best is None or not patience_spent(since + ahead, self.patience):
            return None
        return self.best.round

    def stop_if_stalled(self, step: int) -> bool:
        """Whether the run ends after ``step`` for its patience (logged, in the summary);
        never at its last planned step (nothing to stop)."""
        best = self.stalled()
        if best is None or step >= self.kind.steps(self.settings):
            return False
        self.stopped_early = step
        if self.output_dir is not None:
            log.info(
                "early stop after %s %d: %d %ss have trained since the best on validation, "
                "%s %d (train.patience)",
                self.unit, step, self.patience, self.unit, self.unit, best,
            )  # fmt: skip
        return True

    def test_at_end(
        self,
        test: Callable[[dict[str, torch.Tensor]], dict[str, float]],
        final_state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The test metrics of the state selected on validation and of the final state, for
        rows not tested in their step, written into their rows and checkpoints."""
        if not self.history:
            return
        best, final = self.best, self.history[-1]
        tested: dict[int, dict[str, float]] = {}
        for row in [best, final] if final is not best else [final]:
            if row is None or math.isfinite(row.metrics.get("test_top1", math.nan)):
                continue  # tested in its step
            state = final_state if row is final and final_state is not None else self.state_of(row)
            if row.round not in tested:
                tested[row.round] = test(state)
            row.metrics.update(tested[row.round])
            what = "selected on validation" if row is best else "final"
            log.info("%s %3d (%s) | %s", self.unit, row.round, what, brief(row.metrics))
            checkpoint = self.checkpoint(state, row, epsilon=row.epsilon)
            if row is best:
                save_checkpoint(self.checkpoints / "best", checkpoint)
            save_checkpoint(self.checkpoints / f"round-{row.round:03d}", checkpoint)

    def state_of(self, row: RoundRow) -> dict[str, torch.Tensor]:
        """The trainable state of a recorded row: in memory, else from its checkpoint."""
        if row is self.best and self.best_state is not None:
            return self.best_state
        folder = "best" if row.round == 0 else f"round-{row.round:03d}"
        return load_checkpoint(self.checkpoints / folder).state

    def checkpoint(
        self,
        state: dict[str, torch.Tensor],
        row: RoundRow,
        *,
        round: int | None = None,
        epsilon: float | None = None,
    ) -> Checkpoint:
        return Checkpoint(
            state=state,
            label_map=self.label_map,
            settings=self.settings,
            round=row.round if round is None else round,
            metrics=row.to_dict(),
            epsilon=epsilon,
            extra=dict(self.extra),
        )

    def summary(self, *, complete: bool) -> RunSummary:
        """:attr:`describe`'s summary with the rows' final, best, times and stop."""
        assert self.describe is not None, "a run with files says what its summary holds"
        summary = self.describe()
        summary.initial = self.initial.metrics if self.initial is not None else {}
        summary.final = self.history[-1] if self.history else self.initial
        summary.best = self.best
        summary.total_seconds = time.perf_counter() - self.started
        if self.kind is CENTRALIZED and summary.final is not None:
            summary.epochs = summary.final.epochs
        if self.kind is FEDERATED:
            summary.skipped_rounds = [row.round for row in self.history if row.skipped]
        summary.stopped_early = self.stopped_early
        summary.complete = complete
        return summary

    def write(self, *, complete: bool) -> None:
        """``clients.csv``, ``metrics.json``/``.csv`` and ``curves.png`` (while the run runs,
        at most every :data:`PLOT_SECONDS`). ``clients.csv`` first: a run stopped between the
        two resumes from ``metrics.json``'s last row, with every reply the server saw by then."""
        assert self.output_dir is not None
        summary = self.summary(complete=complete)
        if self.client_rows is not None:
            ClientRow.write_csv(self.output_dir / CLIENTS_CSV, self.client_rows)
        MetricsFile(history=self.history, summary=summary).write(self.output_dir)
        now = time.monotonic()
        if self.plotted_at is not None and now - self.plotted_at < PLOT_SECONDS and not complete:
            return
        self.plotted_at = now
        plot_curves(
            self.output_dir,
            self.history,
            title=self.title,
            x_label=self.unit,
            num_labels=len(self.label_map),
            selected=self.best.round if self.best is not None else None,
        )

    def end(
        self,
        final_state: dict[str, torch.Tensor],
        *,
        round: int | None = None,
        epsilon: float | None = None,
        test: Callable[[dict[str, torch.Tensor]], dict[str, float]] | None = None,
    ) -> RunSummary:
        """The run's end: the test split of the selected and final state (``test``, for rows
        not tested in their step), ``checkpoints/final``, the files, one last log line."""
        if test is not None:
            self.test_at_end(test, final_state)
        last = self.history[-1] if self.history else self.initial
        if last is None:
            raise RuntimeError("no row to save a final checkpoint of")
        checkpoint = self.checkpoint(final_state, last, round=round, epsilon=epsilon)
        save_checkpoint(self.checkpoints / "final", checkpoint)
        self.write(complete=True)
        summary = self.summary(complete=True)
        assert summary.final is not None and summary.best is not None
        log.info(
            "final test top1 %.4f; best on validation after %s %d: test top1 %.4f (%s 0, the "
            "starting point: test top1 %s); results: %s",
            summary.final.metrics["test_top1"],
            self.unit,
            summary.best.round,
            summary.best.metrics["test_top1"],
            self.unit,
            starting_point(summary.initial),
            self.output_dir,
        )
        return summary


def starting_point(initial: dict[str, float] | None) -> str:
    """Step 0's test top-1 for the last line, or why there is none (never "nan")."""
    value = (initial or {}).get("test_top1")
    if value is None or not math.isfinite(value):
        return "not evaluated"
    return f"{value:.4f}"

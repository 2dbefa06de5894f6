"""Which pooling fits a model and a task: CaR (a head on cached features) per pooling variant.

    python scripts/pooling_study.py --model smollm2 --task sms --out docs/results/pooling
    python scripts/pooling_study.py --model gemma3 --task arxiv --out docs/results/pooling
    python scripts/pooling_study.py --model smollm2 --task sms --only eos mean --set seed=1

Every variant is a real centralised run of the product (``car_fl.standalone.centralized``, the code
``car-fl train`` runs) with ``approach=car`` and its ``model.*`` overrides, so a row is
reproduced by ``car-fl train`` with the overrides printed beside it. The selection is on
validation: the variant with the best ``val_top1`` (its best epoch) is the one a preset should
take; test top-1 is printed beside it and never used to choose. Each row carries its wall and
CPU seconds and the load average. Writes ``<task>-<model>.json`` and ``.md`` to ``--out``.

The variants (docs/models.md says what each is): ``eos`` (an appended EOS token's state, the
method's choice), ``last`` (the text's own last token), ``mean`` (mean of the final layer),
``mean-mid`` (mean of the middle block's output), ``prompteol`` (the PromptEOL template, last
token), each also with ``-l2`` (per-example L2 normalisation) where listed; and ``pre`` (the
paper's pre-classifier, 512 units and dropout 0.1, over mean pooling).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from car_fl.settings.compose import load_settings  # noqa: E402
from car_fl.standalone.centralized import run_centralized  # noqa: E402

PROMPTEOL = 'This sentence : "{text}" means in one word:"'
#: The middle block of each model (SmolLM2: 30 blocks, Gemma 3 270M: 18, MiniLM: 6).
MIDDLE = {"smollm2": 15, "gemma3": 9, "minilm": 3}
VARIANTS: dict[str, list[str]] = {
    "eos": ["model.pooling=eos"],
    "last": ["model.pooling=last"],
    "mean": ["model.pooling=mean"],
    "mean-l2": ["model.pooling=mean", "model.normalize=l2"],
    "mean-mid": ["model.pooling=mean", "model.layer=MIDDLE"],
    "prompteol": ["model.pooling=last", f"model.prompt='{PROMPTEOL}'"],
    "prompteol-l2": ["model.pooling=last", f"model.prompt='{PROMPTEOL}'", "model.normalize=l2"],
    "pre": ["model.pooling=mean", "head.pre_classifier_dim=512", "head.dropout=0.1"],
}
DATA = {
    "sms": ROOT.parent / "shared" / "data" / "sms_spam" / "SMSSpamCollection.tsv",
    "arxiv": ROOT.parent / "shared" / "data" / "arxiv_dev" / "arxiv_dev.jsonl",
}


def task_overrides(task: str, data: Path, max_examples: int | None) -> list[str]:
    head = [f"dataset.path={data}"]
    if task == "arxiv":
        head += ["dataset=arxiv", "dataset.min_examples_per_label=50"]
    if max_examples:
        head.append(f"dataset.max_examples={max_examples}")
    return head


def run_variant(
    name: str, model: str, task: str, data: Path, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    overrides = [
        *(["dataset=arxiv"] if task == "arxiv" else []),
        f"model={model}",
        *[o.replace("MIDDLE", str(MIDDLE[model])) for o in VARIANTS[name]],
        *[o for o in task_overrides(task, data, args.max_examples) if o != "dataset=arxiv"],
        f"approach={args.approach}",
        f"train.epochs={args.epochs}",
        f"train.batch_size={args.batch_size}",
        f"train.lr={args.lr}",
        "progress=false",
        *args.overrides,
    ]
    settings = load_settings(overrides)
    before = resource.getrusage(resource.RUSAGE_SELF)
    load_before = os.getloadavg()[0]
    tick = time.perf_counter()
    summary = run_centralized(settings, out / f"{task}-{model}-{name}")
    wall = time.perf_counter() - tick
    after = resource.getrusage(resource.RUSAGE_SELF)
    best = summary["best"]
    return {
        "variant": name + (f" {args.tag}" if args.tag else ""),
        "model": model,
        "task": task,
        "command": "car-fl train " + " ".join(shlex.quote(o) for o in shown(overrides)),
        "val_top1": best.get("val_top1"),
        "test_top1": best["test_top1"],
        "test_mrr": best.get("test_mrr"),
        "selected_epoch": best["round"],
        "epochs": summary["epochs"],
        "train_examples": summary["train_examples"],
        "test_examples": summary["test_examples"],
        "labels": summary["num_labels"],
        "feature_seconds": summary["feature_seconds"],
        "wall_seconds": wall,
        "cpu_seconds": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def shown(overrides: list[str]) -> list[str]:
    """The overrides as a person types them in the clone: data under ``../shared``."""
    shared = str(ROOT.parent / "shared")
    return [o.replace(shared, "../shared") for o in overrides]


def markdown(rows: list[dict[str, Any]]) -> str:
    chosen = max(rows, key=lambda r: r["val_top1"] or 0.0)
    lines = [
        "| variant | val top-1 | test top-1 | test MRR | epoch selected / run | wall s | CPU s | "
        "load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = " (chosen on validation)" if r is chosen else ""
        lines.append(
            f"| {r['variant']}{mark} | {100 * r['val_top1']:.2f} | {100 * r['test_top1']:.2f} | "
            f"{r['test_mrr']:.4f} | {r['selected_epoch']} / {r['epochs']} | "
            f"{r['wall_seconds']:.0f} | {r['cpu_seconds']:.0f} | {r['load'][0]}-{r['load'][1]} |"
        )
    lines += ["", "Commands:", ""] + [f"- {r['variant']}: `{r['command']}`" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(MIDDLE))
    parser.add_argument("--task", required=True, choices=sorted(DATA))
    parser.add_argument("--data", type=Path, help="the task's data file (default: ../shared)")
    parser.add_argument("--max-examples", type=int, help="subsample (say so beside the rows)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--approach", default="car", help="car (default), adapter_car, ...")
    parser.add_argument("--tag", default="", help="a name for these rows (e.g. the lr tried)")
    parser.add_argument("--only", nargs="+", choices=sorted(VARIANTS), help="these variants")
    parser.add_argument("--out", type=Path, default=Path("pooling-study"))
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more setting for every row (repeatable)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    data = args.data or DATA[args.task]
    if not data.is_file():
        parser.error(f"{data} not found; pass --data PATH")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="car-fl-pooling-") as tmp:
        for name in args.only or list(VARIANTS):
            row = run_variant(name, args.model, args.task, data, args, Path(tmp))
            rows.append(row)
            print(
                f"{args.task} {args.model} {name}: val {row['val_top1']:.4f} test "
                f"{row['test_top1']:.4f} (epoch {row['selected_epoch']}), "
                f"{row['wall_seconds']:.0f} s wall, {row['cpu_seconds']:.0f} s CPU, "
                f"load {row['load']}",
                flush=True,
            )
    stem = (
        args.out
        / f"{args.task}-{args.model}{'-' + args.approach if args.approach != 'car' else ''}"
    )
    existing = (
        json.loads(stem.with_suffix(".json").read_text())
        if stem.with_suffix(".json").exists()
        else []
    )
    merged = [r for r in existing if r["variant"] not in {x["variant"] for x in rows}] + rows
    stem.with_suffix(".json").write_text(json.dumps(merged, indent=2))
    stem.with_suffix(".md").write_text(markdown(merged))
    print(markdown(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())

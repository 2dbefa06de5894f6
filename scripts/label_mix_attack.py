"""What each DP mode protects, measured: a curious server reads a node's label mix from its reply.

    python scripts/label_mix_attack.py --out docs/results/label_mix
    python scripts/label_mix_attack.py --shadows 60 --targets 30 --modes none record-3

The shadow-model attack of ``car_fl.simulation.label_mix`` on arXiv subject categories (the
8 most frequent primary categories of ../shared/data/arxiv_dev, MiniLM features from the
product's feature cache): shadow nodes from the training split, target nodes from the
validation and test splits (no text in both), each shard of ``--examples`` papers with a
Dirichlet(0.5) label mix, one round of the node's own release code per node and DP mode.
Writes ``label_mix.json``, ``label_mix.md`` and ``label_mix.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from car_fl.common.progress import on_terminal  # noqa: E402
from car_fl.data.labels import LabelMap  # noqa: E402
from car_fl.data.splits import load_splits  # noqa: E402
from car_fl.model.encoder import shared_encoder  # noqa: E402
from car_fl.model.features import prepare_for  # noqa: E402
from car_fl.model.retriever import CaRRetriever, build_retriever  # noqa: E402
from car_fl.settings.compose import load_settings  # noqa: E402
from car_fl.simulation.label_mix import MixAttack, Pool, attack  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from dp_noise_table import noise_multiplier_for  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "arxiv_dev" / "arxiv_dev.jsonl"
#: What the server sets for every mode (one round, one local epoch, a public bound on n).
BASE = ["fl.rounds=1", "fl.local_epochs=1", "progress=false"]


def modes(examples: int) -> dict[str, list[str]]:
    """Mode label → the run's DP overrides."""
    client_sigma = noise_multiplier_for(3.0, releases=1, delta=1e-5)
    return {
        "none": ["dp=none"],
        "local DP, dp=fixed (the paper's σ₀ 0.1)": ["dp=fixed"],
        "local DP, dp=adaptive (the paper's)": ["dp=adaptive"],
        "record-level DP-SGD, ε 3": [
            "dp=record",
            "dp.target_epsilon=3",
            f"fl.max_examples_per_client={examples}",
        ],
        "client-level, ε 3 (dp=fixed)": ["dp=fixed", f"dp.noise_multiplier={client_sigma:.6g}"],
    }


def pools(data: Path, labels: int) -> tuple[Pool, Pool, LabelMap, list[str]]:
    """Shadow and target pools over the ``labels`` most frequent categories, as features."""
    overrides = ["dataset=arxiv", f"dataset.path={data}", "model=minilm", "model.max_length=64"]
    settings = load_settings([*overrides, "progress=true"])
    splits = load_splits(settings.dataset, seed=settings.seed)
    names = splits.label_map.names
    counts = torch.bincount(torch.as_tensor(splits.train["label"]), minlength=len(names))
    keep = [int(i) for i in counts.argsort(descending=True)[:labels]]
    label_map = LabelMap(tuple(names[i] for i in keep))
    encoder = shared_encoder(settings.model, device=settings.device)

    def pool(parts: list[Any], desc: str) -> Pool:
        texts = [t for part in parts for t in part["text"]]
        ids = [int(i) for part in parts for i in part["label"]]
        chosen = [(t, keep.index(i)) for t, i in zip(texts, ids, strict=True) if i in keep]
        data = prepare_for(
            settings,
            [t for t, _ in chosen],
            [i for _, i in chosen],
            get_model=lambda: CaRRetriever(
                encoder, len(label_map), head=settings.head, mode=settings.train.mode
            ),
            desc=desc,
        )
        assert data.features is not None
        return Pool(features=data.features, labels=data.labels)

    shadow = pool([splits.train], "shadow pool")
    target = pool([splits.validation, splits.test], "target pool")
    return shadow, target, label_map, overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=Path("results/label_mix"))
    parser.add_argument("--labels", type=int, default=8)
    parser.add_argument("--shadows", type=int, default=200)
    parser.add_argument("--targets", type=int, default=100)
    parser.add_argument("--examples", type=int, default=100, help="papers per node")
    parser.add_argument("--modes", nargs="*", help="a subset of the modes, by label prefix")
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"--data {args.data} is not a file (the arXiv dev set: ../shared/data)")
    shadow, target, label_map, data_overrides = pools(args.data, args.labels)
    rows: list[dict[str, Any]] = []
    chosen = modes(args.examples)
    if args.modes:
        chosen = {k: v for k, v in chosen.items() if any(k.startswith(m) for m in args.modes)}
    for label, overrides in chosen.items():
        settings = load_settings([*data_overrides, *BASE, *overrides])
        state = build_retriever(
            settings, len(label_map), hidden_size=int(shadow.features.shape[1])
        ).trainable_state_dict()
        load, wall, cpu = os.getloadavg()[0], time.perf_counter(), _cpu()
        with tqdm(
            total=args.shadows + args.targets, desc=label, disable=not on_terminal()
        ) as progress:
            result: MixAttack = attack(
                settings,
                mode=label,
                shadow_pool=shadow,
                target_pool=target,
                label_map=label_map,
                global_state=state,
                shadows=args.shadows,
                targets=args.targets,
                examples=args.examples,
                progress=progress.update,
            )
        row = {
            **result.to_dict(),
            "overrides": " ".join(shlex.quote(o) for o in [*BASE, *overrides]),
            "wall_seconds": round(time.perf_counter() - wall, 1),
            "cpu_seconds": round(_cpu() - cpu, 1),
            "load": [round(load, 2), round(os.getloadavg()[0], 2)],
        }
        rows.append(row)
        print(
            f"{label}: ε {row['epsilon']:.3g}; majority {row['majority']:.2f} "
            f"(baseline {row['majority_baseline']:.2f}); presence {row['presence']:.2f} "
            f"(baseline {row['presence_baseline']:.2f}); {row['wall_seconds']} s",
            flush=True,
        )
    command = "python scripts/label_mix_attack.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    write(args.out, rows, command=command, labels=list(label_map.names), args=args)
    return 0


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def write(
    out: Path,
    rows: list[dict[str, Any]],
    *,
    command: str,
    labels: list[str],
    args: argparse.Namespace,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": command,
        "labels": labels,
        "shadows": args.shadows,
        "targets": args.targets,
        "examples_per_node": args.examples,
    }
    (out / "label_mix.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "| DP mode | ε (one round, δ 1e-5) | majority label right | baseline | presence right "
        "| baseline | wall s | CPU s | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eps = "∞ (not private)" if r["epsilon"] == float("inf") else f"{r['epsilon']:.3g}"
        lines.append(
            f"| {r['mode']} | {eps} | {r['majority']:.2f} | {r['majority_baseline']:.2f} "
            f"| {r['presence']:.2f} | {r['presence_baseline']:.2f} | {r['wall_seconds']} "
            f"| {r['cpu_seconds']} | {r['load'][0]}-{r['load'][1]} |"
        )
    lines += ["", f"Command: `{command}`", ""]
    (out / "label_mix.md").write_text("\n".join(lines))
    plot(out / "label_mix.png", rows)


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    names = [r["mode"].replace(", ", ",\n", 1) for r in rows]
    for ax, key, title in zip(
        axes, ("majority", "presence"), ("majority label right", "presence right"), strict=True
    ):
        ax.barh(names, [r[key] for r in rows], color="tab:red", label="attack")
        ax.scatter(
            [r[f"{key}_baseline"] for r in rows],
            names,
            color="black",
            zorder=3,
            label="guess without a reply",
        )
        ax.set_xlim(0, 1)
        ax.set_title(title)
        ax.invert_yaxis()
    axes[1].legend(loc="upper right", fontsize=8)
    fig.suptitle("A curious server reads a node's label mix from one reply (arXiv, 8 categories)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

"""Tune record-level DP-SGD on a validation split: in-process FedAvg on cached MiniLM features.

    python scripts/tune_dpsgd.py --epsilon 3 --clients 2 3 [--data PATH] [--grid small] [--draws 5]

Each client's round is the client's own (:func:`car_fl.client.round.train_shard`: under
``dp=record`` its DP-SGD epochs, σ calibrated by ``car_fl.settings.dp_plan.record_plan``, and
its per-client DP state across rounds), on IID shards of cached features, followed by
example-weighted FedAvg, without Flower processes, so that a grid of settings takes minutes.
Models are selected on a validation split: the dataset's own (``DataSplits.validation``) when
it has one, otherwise a seeded stratified 10 % carved from the training split (the clients
train on the rest). The test split is never read. Prints one line per setting, best last,
and writes a JSON file. Each run's DP noise is fresh OS entropy: ``--draws N`` runs every
setting N times, ranks by the mean and prints the draws' range beside it (the best of many
single draws is an optimistic pick).
The non-private reference reads the same features (the ``--base`` model, dataset and seed keys).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import RecordDict

from car_fl.client.round import Shard, local_retriever, train_shard
from car_fl.common.progress import setup_logging
from car_fl.data.labels import LabelMap
from car_fl.data.partition import partition
from car_fl.data.splits import load_splits, stratified_split
from car_fl.model.features import LocalData, prepare_for
from car_fl.model.retriever import build_retriever
from car_fl.settings.compose import NodeInfo, load_settings
from car_fl.settings.dp_plan import record_plan
from car_fl.settings.schema import DPMode, Settings
from car_fl.training.train import evaluate

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/sms_spam/SMSSpamCollection.tsv"
GRIDS: dict[str, dict[str, list[Any]]] = {
    "small": {
        "dp.sample_rate": [0.05, 0.1],
        "fl.local_epochs": [2, 4],
        "train.lr": [0.5, 1.0, 2.0],
        "dp.clip": [0.5, 1.0],
    },
    "tiny": {
        "dp.sample_rate": [0.1],
        "fl.local_epochs": [2],
        "train.lr": [1.0],
        "dp.clip": [1.0],
    },
}


def train_validation(settings: Settings) -> tuple[LocalData, LocalData, LabelMap, str]:
    """Training and validation features, the label map; where the validation split comes from."""
    splits = load_splits(settings.dataset, seed=settings.seed)
    model_holder: dict[str, Any] = {}

    def get_model() -> Any:
        if "m" not in model_holder:
            model_holder["m"] = build_retriever(settings, len(splits.label_map))
        return model_holder["m"]

    validation = getattr(splits, "validation", None)
    if validation is not None:
        train, origin = splits.train, "the dataset's validation split"
    else:
        train_idx, val_idx = stratified_split(
            list(splits.train["label"]), test_fraction=0.1, seed=settings.seed
        )
        train, validation = splits.train.select(train_idx), splits.train.select(val_idx)
        origin = "10 % of the training split (stratified, seeded)"
    features = prepare_for(
        settings, train["text"], train["label"], get_model=get_model, desc="train"
    )
    val = prepare_for(
        settings, validation["text"], validation["label"], get_model=get_model, desc="validation"
    )
    return features, val, splits.label_map, origin


def shards(data: LocalData, label_map: LabelMap, settings: Settings, clients: int) -> list[Shard]:
    """IID shards of the training features, as the federation's clients would hold them."""
    from datasets import Dataset

    index = Dataset.from_dict({"i": list(range(len(data))), "label": data.labels.tolist()})
    out = []
    for pid in range(clients):
        rows = partition(
            index,
            partition_id=pid,
            num_partitions=clients,
            scheme=settings.fl.partitioning,
            alpha=settings.fl.alpha,
            seed=settings.seed,
        )["i"]
        idx = torch.tensor(rows)
        assert data.features is not None
        part = LocalData(labels=data.labels[idx], features=data.features[idx])
        out.append(Shard(data=part, label_map=label_map, examples=len(part)))
    return out


def fedavg(settings: Settings, parts: list[Shard], val: LocalData) -> dict[str, float]:
    """fl.rounds rounds of every client's own round (``train_shard``) and weighted averaging."""
    plan = record_plan(settings) if settings.dp.mode is DPMode.RECORD else None
    model = local_retriever(settings, val, parts[0].label_map)
    global_state = model.trainable_state_dict()
    node_states = [RecordDict() for _ in parts]  # each client's DP state, across rounds
    for server_round in range(1, settings.fl.rounds + 1):
        states, weights = [], []
        for pid, shard in enumerate(parts):
            state, metrics = train_shard(
                settings,
                NodeInfo(partition_id=pid, num_partitions=len(parts)),
                shard,
                global_state,
                server_round,
                node_states[pid],
            )
            states.append(state)
            weights.append(int(metrics["num-examples"]))
        total = sum(weights)
        global_state = {
            k: sum(s[k] * (w / total) for s, w in zip(states, weights, strict=True))
            for k in states[0]
        }
    model.load_trainable_state_dict(global_state)
    metrics = evaluate(model, val, batch_size=256, top_k=[1])
    return {
        "top1": metrics["top1"],
        "macro_f1": metrics["macro_f1"],
        "sigma": plan.noise_multiplier if plan else 0.0,
        "epsilon": plan.epsilon(plan.planned_steps) if plan else float("inf"),
    }


def mean_of_draws(
    settings: Settings, parts: list[Shard], val: LocalData, draws: int
) -> dict[str, Any]:
    """:func:`fedavg` ``draws`` times, the same shuffles each time (seed 0) and fresh OS-entropy
    noise: top-1 and macro-F1 are the means (``top1_draws`` each draw's), so the best setting
    is not simply the luckiest of many single draws."""
    runs = []
    for _ in range(draws):
        torch.manual_seed(0)
        runs.append(fedavg(settings, parts, val))
    mean = {k: sum(r[k] for r in runs) / draws for k in ("top1", "macro_f1")}
    return {**runs[0], **mean, "top1_draws": [r["top1"] for r in runs]}


def spread(draws: list[float]) -> str:
    """The draws' range beside their mean ('' for one draw): how far one run may land."""
    return f" [{min(draws):.4f}-{max(draws):.4f}]" if len(draws) > 1 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="small")
    parser.add_argument(
        "--set",
        nargs="*",
        default=None,
        metavar="KEY=V1,V2",
        help="a grid of your own instead of --grid, e.g. dp.sample_rate=0.1,0.2 train.lr=1,2",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip the non-private runs")
    parser.add_argument(
        "--draws", type=int, default=1, help="noise draws per setting, ranked by their mean"
    )
    parser.add_argument("--base", nargs="*", default=["train.optimizer=sgd"])
    parser.add_argument("--out", type=Path, default=Path("runs/tune-dpsgd.json"))
    args = parser.parse_args()
    if args.draws < 1:
        parser.error(f"--draws must be >= 1, got {args.draws}")
    setup_logging()
    logging.getLogger("car_fl").setLevel(logging.WARNING)
    base = [
        "model=minilm",
        f"dataset.path={args.data.resolve()}",
        "progress=false",
        "dp=record",
        f"dp.target_epsilon={args.epsilon}",
        *args.base,
    ]
    settings = load_settings(base)
    features, val, label_map, origin = train_validation(settings)
    print(f"validation: {origin}, {len(val)} examples; training pool {len(features)}")
    # the reference reads the same features (the base's model and dataset keys), untuned
    same_features = [
        o
        for o in base
        if o.lstrip("+~").split("=")[0].split(".")[0] in ("model", "dataset", "seed")
    ]
    for clients in [] if args.no_reference else args.clients:  # non-private, paper settings
        s = load_settings([*same_features, "progress=false"])
        s.fl.clients = clients
        ref = fedavg(s, shards(features, label_map, s, clients), val)
        print(
            f"non-private FL (paper settings), m={clients}: top1 {ref['top1']:.4f} "
            f"F1 {ref['macro_f1']:.3f}",
            flush=True,
        )
    grid = GRIDS[args.grid]
    if args.set:
        grid = {k: v.split(",") for k, v in (item.split("=", 1) for item in args.set)}
    results = []
    for values in itertools.product(*grid.values()):
        overrides = [f"{k}={v}" for k, v in zip(grid, values, strict=True)]
        row: dict[str, Any] = {"overrides": overrides}
        tick = time.perf_counter()
        for clients in args.clients:
            s = load_settings([*base, *overrides, f"fl.clients={clients}"])
            row[f"{clients}"] = mean_of_draws(
                s, shards(features, label_map, s, clients), val, args.draws
            )
        row["mean_top1"] = sum(row[f"{c}"]["top1"] for c in args.clients) / len(args.clients)
        results.append(row)
        cells = " ".join(
            f"m={c}: top1 {row[f'{c}']['top1']:.4f}{spread(row[f'{c}']['top1_draws'])} "
            f"F1 {row[f'{c}']['macro_f1']:.3f} σ {row[f'{c}']['sigma']:.3g}"
            for c in args.clients
        )
        print(f"{' '.join(overrides):70s} {cells} ({time.perf_counter() - tick:.0f}s)", flush=True)
    results.sort(key=lambda r: r["mean_top1"])
    print("best:", " ".join(results[-1]["overrides"]), f"mean top1 {results[-1]['mean_top1']:.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "validation": origin,
                "epsilon": args.epsilon,
                "draws": args.draws,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

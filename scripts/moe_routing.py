"""What routing alone costs: untrained mixtures of experts against the dense document head.

    OMP_NUM_THREADS=1 python scripts/moe_routing.py --corpus runs/arxiv_2k \\
        "moe.experts=32 moe.route=4" "moe.experts=32 moe.route=4 moe.eval_route=12"

Each argument is one mixture (Hydra overrides after ``approach=moe``); the first row is always
the dense document head (``approach=document``: MIPS with cosine similarity before training).
Every head is car-fl's own, built by ``build_retriever`` on the features in car-fl's cache (the
first run encodes what is missing) and evaluated by ``car_fl.training.train.evaluate`` on the
validation and test queries, untrained: the rows of a mixture are exactly the dense head's, so
any loss of recall is the routing's. One JSON line per head: R@10, the validation loss (finite
also when a true document was not routed), head multiply-adds per query and the ratio to dense.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="folder of arxiv_corpus.py")
    parser.add_argument("mixtures", nargs="+", help='overrides of one mixture, e.g. "moe.route=4"')
    args = parser.parse_args(argv)
    for name in ("documents.jsonl", "queries.jsonl"):
        if not (args.corpus / name).is_file():
            parser.error(f"{args.corpus / name} not found; build it with scripts/arxiv_corpus.py")

    from car_fl.data.splits import load_splits
    from car_fl.model.retriever import build_retriever
    from car_fl.settings.compose import load_settings
    from car_fl.training.train import HeldOut, LazyRetriever, evaluate

    base = [
        "dataset=corpus",
        f"dataset.path={args.corpus / 'queries.jsonl'}",
        f"dataset.documents_path={args.corpus / 'documents.jsonl'}",
        "dataset.new_fraction=0.1",
        "model=minilm",
        "model.document_max_length=256",
        "device=cpu",
        "progress=false",
    ]
    dense_settings = load_settings([*base, "approach=document"])
    splits = load_splits(dense_settings.dataset, seed=dense_settings.seed)
    lazy = LazyRetriever(dense_settings, splits)
    held = HeldOut.prepare(dense_settings, splits, get_model=lazy)
    assert held.test.features is not None and held.validation is not None
    hidden = int(held.test.features.shape[1])
    documents = len(splits.label_map)
    for extra in [["approach=document"], *(["approach=moe", *m.split()] for m in args.mixtures)]:
        settings = load_settings([*base, *extra])
        tick = time.perf_counter()
        model = build_retriever(settings, documents, hidden_size=hidden, documents=lazy.documents)
        val = evaluate(model, held.validation, batch_size=256, top_k=[1, 10])
        test = evaluate(model, held.test, batch_size=256, top_k=[1, 10])
        flops = getattr(model.head, "head_flops_per_query", lambda: documents * hidden)()
        row: dict[str, Any] = {
            "head": " ".join(extra),
            "val_recall@10": round(val["recall@10"], 4),
            "test_recall@10": round(test["recall@10"], 4),
            "val_loss": round(val["loss"], 4),
            "head_macs": flops,
            "fewer_macs": round(documents * hidden / flops, 2),
            "seconds": round(time.perf_counter() - tick, 1),
        }
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``car-fl generate-queries``: training queries for a corpus written by the node's own SLM
(:mod:`car_fl.serving.query_generation`), for ``dataset.generated_queries_path``."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from car_fl.settings.choices import DEVICES

NAME = "generate-queries"
HELP = "write training queries for a corpus with the checkpoint's own causal LM (DSI-QG style)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a corpus checkpoint: its retriever keeps the queries it answers with their "
        "document, and its encoder writes them unless --generator names another model",
    )
    parser.add_argument("--out", required=True, help="the queries file to write (JSONL)")
    parser.add_argument(
        "--generator",
        default=None,
        help="the causal LM that writes the queries (default: the checkpoint's own model, one "
        "copy of the weights in memory); a hub id, folder or GGUF preset (gguf:smollm2)",
    )
    parser.add_argument("--per-document", type=int, default=3, help="queries sampled (3)")
    parser.add_argument(
        "--keep-top-k",
        type=int,
        default=10,
        help="keep a query when its document is in the retriever's top K (10); 0: keep all",
    )
    parser.add_argument("--max-new-tokens", type=int, default=24, help="a query's length (24)")
    parser.add_argument(
        "--max-documents",
        type=int,
        default=None,
        help="a seeded sample of this many documents (default: all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (0)")
    parser.add_argument(
        "--documents",
        default=None,
        help="the corpus's documents file, if not where the checkpoint's settings name it",
    )
    parser.add_argument("--device", default="auto", choices=DEVICES)


def run(args: argparse.Namespace) -> int:
    """Generate, filter, write the kept queries and print a summary."""
    from car_fl.common.hub import offline_unless_reachable

    if args.per_document < 1 or args.keep_top_k < 0 or args.max_new_tokens < 1:
        raise ValueError(
            "--per-document and --max-new-tokens must be >= 1 and --keep-top-k >= 0, got "
            f"{args.per_document}, {args.max_new_tokens}, {args.keep_top_k}"
        )
    if args.max_documents is not None and args.max_documents < 1:
        raise ValueError(f"--max-documents must be >= 1, got {args.max_documents}")
    out = Path(args.out)
    if out.suffix.lower() != ".jsonl":
        raise ValueError(f"--out {out}: write a .jsonl file (it is read as a queries file)")
    offline_unless_reachable()
    from car_fl.common.progress import bar
    from car_fl.model.features import corpus_documents
    from car_fl.results.run import load_checkpoint
    from car_fl.serving.checkpoint import load_retriever
    from car_fl.serving.query_generation import generate_queries, round_trip
    from car_fl.serving.rag import load_generator

    settings = load_checkpoint(args.checkpoint).settings
    if args.documents is not None:
        settings.dataset.documents_path = args.documents
    name = args.generator or settings.model.name_or_path
    generator = load_generator(name, device=args.device, dtype=settings.model.dtype)
    shared = args.generator is None
    retriever = load_retriever(
        args.checkpoint,
        device=args.device,
        documents_path=args.documents,
        encoder=generator.as_encoder(settings.model) if shared else None,
    )
    if retriever.label_names is None or not settings.dataset.documents_path:
        raise ValueError(f"{args.checkpoint} is not a corpus checkpoint (dataset=corpus)")
    documents = corpus_documents(settings, retriever.label_names)
    if args.max_documents is not None and args.max_documents < len(documents):
        chosen = sorted(random.Random(args.seed).sample(range(len(documents)), args.max_documents))
        documents = [documents[i] for i in chosen]
    tick = time.perf_counter()
    ticker = iter(bar(range(len(documents)), desc="documents", unit="doc"))

    def tick_bar(_: int) -> None:
        next(ticker, None)

    generated = generate_queries(
        generator,
        documents,
        per_document=args.per_document,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        progress=tick_bar,
    )
    generation_seconds = time.perf_counter() - tick
    kept = generated
    if args.keep_top_k:
        kept = round_trip(retriever, generated, keep_top_k=args.keep_top_k)
    if not kept:
        raise ValueError(
            f"none of the {len(generated)} generated queries found its document in the top "
            f"{args.keep_top_k}; raise --keep-top-k, or filter with a trained checkpoint"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for query in kept:
            row = {"query": query.text, "document_id": query.document_id, "rank": query.rank}
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    summary = {
        "documents": len(documents),
        "generated": len(generated),
        "kept": len(kept),
        "keep_top_k": args.keep_top_k,
        "generator": name,
        "generation_seconds": round(generation_seconds, 1),
        "seconds": round(time.perf_counter() - tick, 1),
    }
    out.with_suffix(".summary.json").write_text(json.dumps(summary, indent=2) + "\n", "utf-8")
    print(
        f"{len(kept)} of {len(generated)} queries kept for {len(documents)} documents "
        f"(top-{args.keep_top_k} round trip) in {summary['seconds']} s: {out}"
    )
    return 0

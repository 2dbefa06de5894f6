"""``car-fl ask``: retrieve a question's top-K documents and let a causal LM answer from them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from car_fl.commands.retrieve import shorten
from car_fl.settings.choices import DEVICES

if TYPE_CHECKING:  # the command imports the model code only when it runs
    from car_fl.heads.scorer import Hit

NAME = "ask"
HELP = "answer a question with a causal LM from a corpus checkpoint's top-K documents (RAG)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("question", help="the question")
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a corpus checkpoint folder, e.g. runs/<run>/checkpoints/best",
    )
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--generator",
        help="the causal LM that answers: a hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct), a folder, "
        "or a GGUF preset (gguf:smollm2)",
    )
    who.add_argument(
        "--same-model",
        action="store_true",
        help="the checkpoint's own encoder answers too: one copy of the weights in memory "
        "(it must be a causal LM, e.g. model=smollm2)",
    )
    parser.add_argument("-k", type=int, default=3, help="how many documents it reads (3)")
    parser.add_argument(
        "--documents",
        default=None,
        help="the corpus's documents file, if not where the checkpoint's settings name it",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="encoder hub id or folder, if not the one the checkpoint was trained with",
    )
    parser.add_argument(
        "--blocks-service",
        default=None,
        help="run the encoder's transformer blocks on this blocks service (car-fl serve-blocks), "
        "e.g. http://127.0.0.1:8200/blocks; this machine keeps its embeddings, norm and head",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="most tokens generated (128)"
    )
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the generator's hub repository run its own code",
    )
    parser.add_argument(
        "--instruction",
        default=None,
        help="what the generator is told before the documents (default: answer from the "
        "documents only, or say you do not know; 'plain': answer using the documents, which "
        "very small models such as SmolLM2-135M follow better)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    """Retrieve, prompt, generate; print the answer and its sources."""
    from car_fl.common.hub import offline_unless_reachable

    offline_unless_reachable()  # no Hub: the loaders read the local cache, and fail in seconds
    from car_fl.serving.checkpoint import load_retriever
    from car_fl.serving.rag import INSTRUCTION, PLAIN_INSTRUCTION, load_generator
    from car_fl.serving.retrieval_api import corpus_titles

    if args.k < 1:
        raise ValueError(f"-k must be >= 1, got {args.k}")
    # the generator first: a wrong name fails before the retriever is loaded
    encoder = None
    if args.same_model:
        from car_fl.results.run import load_checkpoint

        model = load_checkpoint(args.checkpoint).settings.model
        if args.model is not None:
            model.name_or_path = args.model
        generator = load_generator(
            model.name_or_path,
            device=args.device,
            trust_remote_code=args.trust_remote_code,
            dtype=model.dtype,
        )
        encoder = generator.as_encoder(model)
    else:
        generator = load_generator(
            args.generator, device=args.device, trust_remote_code=args.trust_remote_code
        )
    check_corpus(args.checkpoint)  # a checkpoint of labels has nothing to answer from
    retriever = load_retriever(
        args.checkpoint,
        device=args.device,
        model=args.model,
        blocks_service=args.blocks_service,
        documents_path=args.documents,
        encoder=encoder,
    )
    hits = retriever.retrieve([args.question], args.k)[0].hits
    instruction = {None: INSTRUCTION, "plain": PLAIN_INSTRUCTION}.get(
        args.instruction, args.instruction
    )
    answer = generator.answer(
        args.question, hits, max_new_tokens=args.max_new_tokens, instruction=instruction
    )
    titles = corpus_titles(retriever)  # with --documents, from that file
    if args.json:
        payload = {
            "question": args.question,
            "answer": answer.text,
            "sources": [
                {"id": h.id, "title": titles.get(h.id, ""), "score": h.score, "text": h.text}
                for h in hits
            ],
        }
        print(json.dumps(payload, indent=2))
    else:
        print(answer.text if answer.text.strip() else "(the generator wrote no answer)")
        print()
        print("Sources:")
        for line in source_lines(hits, titles):
            print(line)
    return 0


def check_corpus(checkpoint: str) -> None:
    """A checkpoint of labels has no documents to answer from: refused in one line."""
    from car_fl.results.run import load_checkpoint
    from car_fl.settings.choices import Reader

    ckpt = load_checkpoint(checkpoint)
    if ckpt.settings.dataset.reader is not Reader.CORPUS:
        names = ckpt.label_map.names
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ValueError(
            f"{checkpoint} retrieves labels ({len(names)}: {shown}), not documents with a text "
            "to answer from: use car-fl retrieve with it, or train on a corpus (dataset=corpus "
            "dataset.documents_path=...) for car-fl ask"
        )


def source_lines(hits: Sequence[Hit], titles: Mapping[str, str], *, width: int = 80) -> list[str]:
    """One line per retrieved document, stated by car-fl itself whatever the generator wrote:
    rank, id, score and its title (else the start of its text)."""
    lines = []
    for rank, hit in enumerate(hits, 1):
        name = shorten(titles.get(hit.id) or hit.text, width)
        lines.append(f"  {rank:>2d}. {hit.id}\t{hit.score:.4f}\t{name}")
    return lines

"""End-to-end RAG on a document corpus: does the answer name the right paper?

    python scripts/arxiv_corpus.py ../shared/data/arxiv_dev/arxiv_dev.jsonl runs/arxiv_1k \
        --sample 1000 --seed 0
    python scripts/rag_benchmark.py --corpus runs/arxiv_1k --out runs/bench/rag \
        --retriever "MIPS (MiniLM)=runs/bench/slm_docs_minilm/mips" ... --queries 60

For a seeded sample of held-out test queries (an abstract's last sentence, never inside its
document's text), the generator is asked which paper the sentence comes from, with the top-3
documents of each retriever in the prompt (``car_fl.serving.rag``: the same prompt and greedy
decoding as ``car-fl ask --instruction plain``). An answer *names the paper* when some span of
the answer as long as the title has token F1 >= ``--f1`` (0.5) against the paper's title
(SQuAD's normalisation: lower case, no punctuation or articles). Rows: no retrieval, each
``--retriever`` (a run folder: its ``checkpoints/best``, else ``final``), and the true
document first in the prompt (the generator's ceiling: the true document, then the last
retriever's next two). A retriever whose
encoder is the generator's own model shares its weights (``Generator.as_encoder``).
The sources car-fl states are the prompt's documents, best first, whatever the generator
writes (``car-fl ask``): *cites the paper* is the share of questions whose first source is the
true paper. Each row also gives retrieval and answer seconds per question. ``--memory`` also
measures the peak memory of one ``car-fl ask`` per retriever, each in a fresh process: with the
generator's own weights as the encoder (one model) or the retriever's encoder beside the
generator (two models). ``--reuse FOLDER`` takes an earlier run's answer for a question whose
prompt holds the same documents (greedy decoding gives the same text), so a larger sample only
generates the new questions; its answer seconds count generated answers only.
Writes ``results.json``, ``answers.jsonl`` (every question, prompt's documents and answer) and
``table.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import resource
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

QUESTION = 'What is the title of the paper that says: "{sentence}"?'
CEILING = "true document first (ceiling)"
NONE = "no retrieval"


def normalise(text: str) -> list[str]:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def f1(got: list[str], want: list[str]) -> float:
    common = sum((collections.Counter(got) & collections.Counter(want)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)


def title_f1(answer: str, title: str) -> float:
    """The best token F1 of the title against any span of the answer as long as the title,
    after :func:`normalise`: a verbose answer that names the title scores as the title does."""
    got, want = normalise(answer), normalise(title)
    if not got or not want:
        return 0.0
    width = min(len(want), len(got))
    return max(f1(got[i : i + width], want) for i in range(len(got) - width + 1))


def checkpoint_of(run: Path) -> Path:
    for name in ("best", "final"):
        if (run / "checkpoints" / name).is_dir():
            return run / "checkpoints" / name
    raise SystemExit(f"{run} has no checkpoints/best or checkpoints/final")


def load_queries(corpus: Path, count: int, seed: int) -> list[dict[str, str]]:
    rows = [json.loads(line) for line in (corpus / "queries.jsonl").open(encoding="utf-8")]
    test = [r for r in rows if r["split"] == "test"]
    return random.Random(seed).sample(test, min(count, len(test)))


def peak_memory(checkpoint: Path, generator: str, shared: bool) -> dict[str, Any]:
    """Peak RSS of one ``car-fl ask`` in a fresh process: one copy of the weights or two."""
    how = ["--same-model"] if shared else ["--generator", generator]
    # VmHWM, not ru_maxrss: Linux carries a parent's peak RSS into its child across fork and
    # exec, so ru_maxrss would report this (larger) benchmark process instead.
    code = (
        "import re, sys; from car_fl.cli import main; "
        "code = main(sys.argv[1:]); "
        "status = open('/proc/self/status').read(); "
        "hwm, rss = (re.search(k + r':\\s+(\\d+)', status).group(1) for k in ('VmHWM', 'VmRSS')); "
        "print('PEAK', hwm, 'RSS', rss); sys.exit(code)"
    )
    args = ["ask", "--checkpoint", str(checkpoint), *how, "--device", "cpu"]
    args += ["--max-new-tokens", "8", "which paper studies federated learning?"]
    tick = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"car-fl ask failed: {done.stderr.strip().splitlines()[-1:]}")
    peak_kib, rss_kib = (int(done.stdout.split(key)[-1].split()[0]) for key in ("PEAK", "RSS"))
    return {
        "copies": 1 if shared else 2,
        "peak_rss_mib": round(peak_kib / 1024),
        "rss_after_answer_mib": round(rss_kib / 1024),
        "seconds": round(time.perf_counter() - tick, 1),
    }


def seconds(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else "reused"


def reusable_answers(
    folder: Path, args: argparse.Namespace
) -> dict[tuple[str, tuple[str, ...]], str]:
    """An earlier run's answers by (sentence, prompt's document ids), if it asked the same way."""
    earlier = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    if "max_new_tokens" not in earlier:  # written before the key was recorded: its command says
        found = re.search(r"--max-new-tokens (\d+)", earlier["command"])
        earlier["max_new_tokens"] = int(found.group(1)) if found else 48
    same = {"generator": args.generator, "k": args.k, "max_new_tokens": args.max_new_tokens}
    differs = {key: earlier.get(key) for key, value in same.items() if earlier.get(key) != value}
    if differs:
        raise SystemExit(
            f"--reuse {folder}: it was run with {differs}, this run asks {same}; "
            "answers are reusable only for the same generator, k and --max-new-tokens"
        )
    rows = map(json.loads, (folder / "answers.jsonl").open(encoding="utf-8"))
    return {(a["sentence"], tuple(a["sources"])): a["answer"] for a in rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="folder of arxiv_corpus.py")
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument(
        "--retriever",
        action="append",
        default=[],
        metavar="NAME=RUN",
        help="a row: its name and a run folder (repeat; the last is the ceiling's fallback)",
    )
    parser.add_argument("--generator", default="gguf:smollm2", help="causal LM (gguf:smollm2)")
    parser.add_argument("--queries", type=int, default=60, help="seeded sample of test queries")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-k", type=int, default=3, help="documents in the prompt (3)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--f1", type=float, default=0.5, help="token F1 that names the paper")
    parser.add_argument(
        "--reuse",
        type=Path,
        help="an earlier --out folder: its answers to the same prompts are taken, not regenerated",
    )
    parser.add_argument("--memory", action="store_true", help="also peak memory: 1 vs 2 copies")
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="only the peak memory of each retriever's car-fl ask (memory.json), no answers",
    )
    args = parser.parse_args(argv)
    from car_fl.heads.scorer import Hit
    from car_fl.model.gguf import resolve
    from car_fl.results.run import load_checkpoint
    from car_fl.serving.checkpoint import load_retriever
    from car_fl.serving.rag import PLAIN_INSTRUCTION, load_generator

    retrievers: dict[str, Path] = {}
    for item in args.retriever:
        name, _, run = item.partition("=")
        if not run:
            parser.error(f"--retriever {item!r}: write NAME=RUN_FOLDER")
        retrievers[name] = checkpoint_of(Path(run))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.memory_only:
        memory_rows = []
        for name, ckpt in retrievers.items():
            model_path = load_checkpoint(ckpt).settings.model.name_or_path
            shared = resolve(model_path) == resolve(args.generator)
            memory_rows.append({"row": name, **peak_memory(ckpt, args.generator, shared)})
            print(json.dumps(memory_rows[-1]), flush=True)
        command = "python " + " ".join(["scripts/rag_benchmark.py", *(argv or sys.argv[1:])])
        record = {"command": command, "load": list(os.getloadavg()), "memory": memory_rows}
        (args.out / "memory.json").write_text(json.dumps(record, indent=2) + "\n", "utf-8")
        return 0
    reused = reusable_answers(args.reuse, args) if args.reuse else {}
    documents = {d["id"]: d for d in map(json.loads, (args.corpus / "documents.jsonl").open())}
    queries = load_queries(args.corpus, args.queries, args.seed)
    load = [round(x, 2) for x in os.getloadavg()]
    generator = load_generator(args.generator, device="cpu")
    generator_folder = resolve(args.generator)

    hits_by_row: dict[str, list[list[Hit]]] = {NONE: [[] for _ in queries]}
    retrieval_seconds: dict[str, float] = {NONE: 0.0}
    texts = [q["query"] for q in queries]
    for name, ckpt in retrievers.items():
        model = load_checkpoint(ckpt).settings.model
        shared = resolve(model.name_or_path) == generator_folder
        retriever = load_retriever(
            ckpt,
            device="cpu",
            documents_path=args.corpus / "documents.jsonl",
            encoder=generator.as_encoder(model) if shared else None,
        )
        tick = time.perf_counter()
        hits_by_row[name] = [r.hits for r in retriever.retrieve(texts, args.k)]
        retrieval_seconds[name] = time.perf_counter() - tick
    if retrievers:  # the ceiling: the true document first, then the last retriever's next ones
        last = hits_by_row[list(retrievers)[-1]]
        ceiling = []
        for query, hits in zip(queries, last, strict=True):
            truth = documents[query["document_id"]]
            others = [h for h in hits if h.id != truth["id"]][: args.k - 1]
            ceiling.append([Hit(truth["id"], truth["text"], 1.0), *others])
        hits_by_row[CEILING] = ceiling
        retrieval_seconds[CEILING] = retrieval_seconds[list(retrievers)[-1]]

    rows, answers = [], []
    for name, per_query in hits_by_row.items():
        tick = time.perf_counter()
        named = in_prompt = cited = generated = 0
        answer_seconds = 0.0
        f1s = []
        for query, hits in zip(queries, per_query, strict=True):
            title = documents[query["document_id"]]["title"]
            question = QUESTION.format(sentence=query["query"])
            sources = [h.id for h in hits]
            text = reused.get((query["query"], tuple(sources)))
            if text is None:
                started = time.perf_counter()
                answer = generator.answer(
                    question,
                    hits,
                    max_new_tokens=args.max_new_tokens,
                    instruction=PLAIN_INSTRUCTION,
                )
                answer_seconds += time.perf_counter() - started
                generated += 1
                text, sources = answer.text, list(answer.sources)
            score = title_f1(text, title)
            f1s.append(score)
            named += score >= args.f1
            in_prompt += any(h.id == query["document_id"] for h in hits)
            cited += bool(sources) and sources[0] == query["document_id"]
            answers.append(
                {
                    "row": name,
                    "sentence": query["query"],
                    "title": title,
                    "sources": sources,
                    "answer": text,
                    "f1": round(score, 3),
                }
            )
        rows.append(
            {
                "row": name,
                "names_the_paper": named / len(queries),
                "mean_f1": sum(f1s) / len(f1s),
                "true_document_in_prompt": in_prompt / len(queries),
                "cites_the_paper": cited / len(queries),
                "seconds": round(time.perf_counter() - tick, 1),
                "retrieval_seconds_per_question": round(retrieval_seconds[name] / len(queries), 4),
                "answers_generated": generated,
                "answer_seconds_per_question": (
                    round(answer_seconds / generated, 2) if generated else None
                ),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    memory = []
    if args.memory:
        for name, ckpt in retrievers.items():
            model_path = load_checkpoint(ckpt).settings.model.name_or_path
            shared = resolve(model_path) == generator_folder
            memory.append({"row": name, **peak_memory(ckpt, args.generator, shared)})
    command = "python " + " ".join(["scripts/rag_benchmark.py", *(argv or sys.argv[1:])])
    result = {
        "command": command,
        "queries": len(queries),
        "seed": args.seed,
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "reused_from": str(args.reuse) if args.reuse else None,
        "generator": args.generator,
        "f1_threshold": args.f1,
        "load_before": load,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
        "memory": memory,
        "peak_rss_mib_this_process": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        ),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    with (args.out / "answers.jsonl").open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(a, ensure_ascii=False) + "\n" for a in answers)
    lines = [
        f"{len(queries)} test sentences (seed {args.seed}), top-{args.k} documents, generator "
        f"{args.generator}; names the paper: token F1 with its title >= {args.f1}",
        "",
        "| prompt's documents | names the paper | mean F1 | true document in prompt "
        "| cites the paper | retrieval s/question | answer s/question |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['row']} | {r['names_the_paper']:.1%} | {r['mean_f1']:.3f} | "
        f"{r['true_document_in_prompt']:.1%} | {r['cites_the_paper']:.1%} | "
        f"{r['retrieval_seconds_per_question']:.3f} | {seconds(r['answer_seconds_per_question'])} |"
        for r in rows
    ]
    if memory:
        lines += [
            "",
            "| retriever | models in memory | peak RSS (MiB) | RSS after the answer (MiB) | s |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {m['row']} | {m['copies']} | {m['peak_rss_mib']:,} | "
            f"{m['rss_after_answer_mib']:,} | {m['seconds']} |"
            for m in memory
        ]
    (args.out / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

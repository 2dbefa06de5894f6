"""A worked RAG example, offline: a car-fl retriever trained by a federation, in a LangChain chain.

    python scripts/rag_example.py --papers 300        # arXiv dev papers, MiniLM, SmolLM2 answers
    python scripts/rag_example.py --papers 300 --framework llamaindex   # a LlamaIndex query engine
    python scripts/rag_example.py --smoke             # tiny models and corpus (a test)

Steps: (1) the first ``--papers`` papers of the arXiv dev set become a corpus
(scripts/arxiv_corpus.py: papers are documents, their sentences queries); (2) a federation of
``--clients`` nodes trains a document head on it for ``--rounds`` rounds, in this process
(:func:`car_fl.simulation.in_process.run_local`, the real ServerApp and ClientApp handlers);
(3) a LangChain chain retrieves with :class:`car_fl.serving.langchain_retriever.CarFlRetriever`
from the run's best checkpoint (``--framework llamaindex``: a LlamaIndex query engine with
:class:`car_fl.serving.llamaindex_retriever.CarFlLlamaRetriever`) and answers with the local
generator (:func:`car_fl.serving.rag.load_generator`, ``gguf:smollm2``). Prints the question, the
retrieved documents (id, score, title) and the answer. ``--url`` retrieves from a running
``car-fl serve`` of that checkpoint instead.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ARXIV = ROOT.parent / "shared" / "data" / "arxiv_dev" / "arxiv_dev.jsonl"
#: Asked unless --question says otherwise: the subject of one of the first 300 papers (the
#: corpus is 2007-08 arXiv physics and mathematics; a question it cannot answer shows little).
QUESTION = "How can an electrostatic device harvest energy from vibrations?"


def corpus(papers: int, work: Path, *, smoke: bool) -> tuple[Path, Path]:
    """``documents.jsonl`` and ``queries.jsonl`` of the first ``papers`` arXiv dev papers."""
    from car_fl.testing.tiny import write_corpus

    if smoke:
        return write_corpus(work / "corpus")
    out = work / "corpus"
    script = ROOT / "scripts" / "arxiv_corpus.py"
    subprocess.run(
        [sys.executable, str(script), str(ARXIV), str(out), "--limit", str(papers)], check=True
    )
    return out / "documents.jsonl", out / "queries.jsonl"


def federated_checkpoint(
    documents: Path, queries: Path, work: Path, args: argparse.Namespace
) -> Path:
    """The best checkpoint of a federation trained on the corpus in this process."""
    from car_fl.settings.compose import load_settings
    from car_fl.simulation.in_process import run_local
    from car_fl.testing.tiny import build_llama, tiny_overrides

    if args.smoke:
        model = tiny_overrides(build_llama(work / "tiny-llama"), queries, cache_dir=work / "cache")
    else:
        model = [f"model={args.model}", f"dataset.path={queries}", f"cache_dir={work / 'cache'}"]
        model += ["progress=false", "model.document_max_length=256"]
    overrides = [
        *model,
        "dataset=corpus",
        f"dataset.documents_path={documents}",
        "approach=document",
        f"fl.clients={args.clients}",
        f"fl.rounds={args.rounds}",
        f"output_dir={work / 'federation'}",
    ]
    run_local(load_settings(overrides))
    return work / "federation" / "checkpoints" / "best"


def chain_for(retriever: Any, generator: Any, *, max_new_tokens: int) -> Any:
    """question → {documents, question} → the generator's answer with its sources."""
    from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough

    from car_fl.heads.scorer import Hit

    def answer(found: dict[str, Any]) -> dict[str, Any]:
        hits = [
            Hit(id=d.id, text=d.page_content, score=d.metadata["score"]) for d in found["documents"]
        ]
        reply = generator.answer(found["question"], hits, max_new_tokens=max_new_tokens)
        return {"answer": reply.text, "documents": found["documents"]}

    fetch = RunnableParallel(documents=retriever, question=RunnablePassthrough())
    return fetch | RunnableLambda(answer)


def query_engine_for(retriever: Any, generator: Any, *, max_new_tokens: int) -> Any:
    """A LlamaIndex query engine: the retriever's nodes → the generator's answer, the nodes as
    its sources (a ``CustomQueryEngine``: the generator is car-fl's, not a LlamaIndex LLM)."""
    from llama_index.core.base.response.schema import Response
    from llama_index.core.query_engine import CustomQueryEngine

    from car_fl.heads.scorer import Hit

    class Engine(CustomQueryEngine):
        def custom_query(self, query_str: str) -> Response:
            nodes = retriever.retrieve(query_str)
            hits = [Hit(id=n.node.node_id, text=n.node.get_content(), score=n.score) for n in nodes]
            reply = generator.answer(query_str, hits, max_new_tokens=max_new_tokens)
            return Response(reply.text, source_nodes=nodes)

    return Engine()


def ask(args: argparse.Namespace, checkpoint: Path, generator: Any) -> tuple[list, str]:
    """(rank, id, score, title) of each retrieved document and the answer, through the chosen
    framework."""
    if args.framework == "llamaindex":
        from car_fl.serving.llamaindex_retriever import CarFlLlamaRetriever

        index = (
            CarFlLlamaRetriever.from_endpoint(args.url, k=args.k)
            if args.url
            else CarFlLlamaRetriever.from_checkpoint(checkpoint, k=args.k, device="cpu")
        )
        response = query_engine_for(index, generator, max_new_tokens=args.max_new_tokens).query(
            args.question
        )
        rows = [
            (
                n.node.metadata["rank"],
                n.node.node_id,
                n.score,
                _title(n.node.metadata, n.node.get_content()),
            )
            for n in response.source_nodes
        ]
        return rows, str(response.response)
    from car_fl.serving.langchain_retriever import CarFlRetriever

    retriever = (
        CarFlRetriever.from_endpoint(args.url, k=args.k)
        if args.url
        else CarFlRetriever.from_checkpoint(checkpoint, k=args.k, device="cpu")
    )
    result = chain_for(retriever, generator, max_new_tokens=args.max_new_tokens).invoke(
        args.question
    )
    rows = [
        (d.metadata["rank"], d.id, d.metadata["score"], _title(d.metadata, d.page_content))
        for d in result["documents"]
    ]
    return rows, str(result["answer"])


def _title(metadata: dict[str, Any], text: str) -> str:
    return str(metadata.get("title") or " ".join(text.split())[:60])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--papers", type=int, default=300, help="arXiv dev papers in the corpus")
    parser.add_argument("--model", default="minilm", help="the retriever's encoder (model=...)")
    parser.add_argument("--generator", default="gguf:smollm2", help="hub id, folder or GGUF")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-k", type=int, default=3, help="documents the generator reads")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--url", default=None, help="retrieve from this car-fl serve instead")
    parser.add_argument(
        "--framework", choices=["langchain", "llamaindex"], default="langchain", help="whose chain"
    )
    parser.add_argument("--work", type=Path, default=None, help="corpus and run (default: temp)")
    parser.add_argument("--smoke", action="store_true", help="tiny models and corpus (a test)")
    args = parser.parse_args(argv)
    from car_fl.serving.rag import load_generator
    from car_fl.testing.tiny import build_llama

    work = args.work or Path(tempfile.mkdtemp(prefix="rag-example-"))
    work.mkdir(parents=True, exist_ok=True)
    if not args.smoke and not ARXIV.is_file():
        parser.error(f"{ARXIV} not found (the arXiv dev set)")
    documents, queries = corpus(args.papers, work, smoke=args.smoke)
    checkpoint = federated_checkpoint(documents, queries, work, args)
    if args.smoke:
        args.generator = str(build_llama(work / "tiny-generator", causal=True))
        args.question, args.max_new_tokens = "w5 w25", 4
    generator = load_generator(args.generator, device="cpu")
    rows, answer = ask(args, checkpoint, generator)
    print(f"checkpoint: {checkpoint}")
    print(f"question: {args.question} ({args.framework})")
    for rank, doc_id, score, title in rows:
        print(f"  {rank}. {doc_id}\t{score:.4f}\t{title}")
    print(f"answer: {answer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training queries written by the node's own causal LM, kept by a round trip (DSI-QG style).

The generator samples ``per_document`` queries per document (top-k sampling); a query is kept
only when the retriever being trained ranks its document within ``keep_top_k`` (Zhuang et al.,
2022, with the retriever as the filter). Documents and model are public to the federation, so
a generated query carries nothing of any node's records.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from car_fl.serving.rag import cut_to_tokens

if TYPE_CHECKING:
    from car_fl.data.corpus import Document
    from car_fl.model.retriever import CaRRetriever
    from car_fl.serving.rag import Generator

#: What the generator is asked, with the document's text in place of ``{text}``.
PROMPT = "Write one short search query that the following text answers.\n\nText: {text}"
#: The document's tokens the prompt holds at most (a query needs its gist, not all of it).
DOCUMENT_TOKENS = 256
#: DSI-QG samples from the 10 likeliest tokens.
TOP_K = 10
#: A label a small model may echo before its query ("Query:", "Search query -", "Text:").
_PREFIX = re.compile(r"^\s*((search\s+)?query|text)\s*[:\-]\s*", re.IGNORECASE)


@dataclass(frozen=True)
class GeneratedQuery:
    """A query written for a document, and where the filtering retriever ranked that
    document (1: first; ``None``: not within the top-k asked, or not filtered)."""

    text: str
    document_id: str
    rank: int | None = None


def clean_query(text: str) -> str:
    """A generated text as a query: its first non-empty line, without a ``Query:`` (or the
    prompt's ``Text:``) prefix or surrounding quotes, whitespace collapsed ('' when nothing is
    left)."""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    line = _PREFIX.sub("", line).strip().strip("\"'“”`").strip()
    return " ".join(line.split())


def prompt_for(generator: Generator, text: str, *, document_tokens: int = DOCUMENT_TOKENS) -> str:
    """The generation prompt for one document: a chat turn when the tokenizer has a template."""
    body = PROMPT.format(text=cut_to_tokens(text, generator.tokenizer, document_tokens))
    if getattr(generator.tokenizer, "chat_template", None):
        out: str = generator.tokenizer.apply_chat_template(
            [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
        )
        return out
    return f"{body}\nQuery:"


def generate_queries(
    generator: Generator,
    documents: Sequence[Document],
    *,
    per_document: int,
    seed: int,
    max_new_tokens: int = 24,
    document_tokens: int = DOCUMENT_TOKENS,
    progress: Callable[[int], None] | None = None,
) -> list[GeneratedQuery]:
    """Up to ``per_document`` distinct queries per document, in document order; sampling is
    seeded per document (``seed`` and its position), so a rerun writes the same queries."""
    import torch

    if per_document < 1 or max_new_tokens < 1:
        raise ValueError(
            f"per_document and max_new_tokens must be >= 1, got {per_document}, {max_new_tokens}"
        )
    tokenizer, model = generator.tokenizer, generator.model
    templated = bool(getattr(tokenizer, "chat_template", None))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[GeneratedQuery] = []
    for position, document in enumerate(documents):
        prompt = prompt_for(generator, document.text, document_tokens=document_tokens)
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not templated)
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        torch.manual_seed(seed * 1_000_003 + position)
        with torch.inference_mode():
            sampled = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                top_k=TOP_K,
                num_return_sequences=per_document,
                pad_token_id=pad,
            )
        seen: set[str] = set()
        for row in sampled[:, inputs["input_ids"].shape[1] :]:
            text = clean_query(str(tokenizer.decode(row, skip_special_tokens=True)))
            if text and text.casefold() not in seen:
                seen.add(text.casefold())
                out.append(GeneratedQuery(text, document.id))
        if progress is not None:
            progress(1)
    return out


def round_trip(
    retriever: CaRRetriever,
    queries: Sequence[GeneratedQuery],
    *,
    keep_top_k: int,
    batch: int = 256,
) -> list[GeneratedQuery]:
    """The queries whose own document ``retriever`` ranks within ``keep_top_k``, with that
    rank; the others are dropped."""
    if keep_top_k < 1:
        raise ValueError(f"keep_top_k must be >= 1, got {keep_top_k}")
    kept: list[GeneratedQuery] = []
    for start in range(0, len(queries), batch):
        chunk = queries[start : start + batch]
        results = retriever.retrieve([q.text for q in chunk], keep_top_k)
        for query, result in zip(chunk, results, strict=True):
            ids = [hit.id for hit in result.hits]
            if query.document_id in ids:
                kept.append(
                    GeneratedQuery(query.text, query.document_id, ids.index(query.document_id) + 1)
                )
    return kept

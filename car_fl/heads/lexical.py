"""A lexical index over the documents: BM25 through ``bm25s``, beside the trained head.

Built from the public documents alone, so every party builds the same one; its tokens are
``bm25s``'s words, lower-cased, English stop words removed, not stemmed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class LexicalIndex:
    """BM25 (Lucene's variant, k1 1.5, b 0.75) over ``documents``, in label order, indexed on
    the first :meth:`scores`."""

    def __init__(self, documents: Sequence[str]) -> None:
        if not documents:
            raise ValueError("a lexical index needs at least one document")
        self.size = len(documents)
        self._documents = list(documents)
        self._index: tuple[Any, Any] | None = None

    def _built(self) -> tuple[Any, Any]:
        if self._index is None:
            import bm25s
            from bm25s.tokenization import Tokenizer

            tokenizer = Tokenizer(stopwords="en")
            tokens = tokenizer.tokenize(self._documents, return_as="ids", show_progress=False)
            bm25 = bm25s.BM25()
            bm25.index(tokens, show_progress=False)
            self._index = tokenizer, bm25
        return self._index

    @property
    def built(self) -> bool:
        return self._index is not None

    def scores(self, queries: Sequence[str]) -> torch.Tensor:
        """BM25 scores ``(queries, documents)`` in float32; a word no document holds scores 0."""
        tokenizer, bm25 = self._built()
        tokens = tokenizer.tokenize(
            list(queries), update_vocab=False, return_as="ids", show_progress=False
        )
        rows = [bm25.get_scores(ids) for ids in tokens]
        if not rows:
            return torch.zeros(0, self.size)
        return torch.from_numpy(np.stack(rows).astype(np.float32))

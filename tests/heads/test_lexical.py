"""car_fl.heads.lexical: BM25 over the documents' words."""

from __future__ import annotations

import pytest
import torch

from car_fl.heads.lexical import LexicalIndex

DOCUMENTS = [
    "Torsional elastic waves in a double wall tube",
    "Dark matter halos and the rotation of galaxies",
    "The rotation of a rigid tube under torsion",
]


def test_a_rare_word_finds_its_document_and_stop_words_count_for_nothing() -> None:
    index = LexicalIndex(DOCUMENTS)
    assert not index.built  # a client that only trains never pays for it
    scores = index.scores(["elastic waves", "galaxies", "the of a in", "quasar", ""])
    assert scores.shape == (5, 3) and scores.dtype == torch.float32
    assert int(scores[0].argmax()) == 0 and scores[0, 1] == 0
    assert int(scores[1].argmax()) == 1 and scores[1, [0, 2]].eq(0).all()
    assert scores[2:].eq(0).all()  # stop words, a word no document holds, nothing
    shared = index.scores(["rotation tube"])[0]
    assert shared[2] > shared[0] > 0 and shared[2] > shared[1] > 0  # both words beat one
    assert index.scores([]).shape == (0, 3)


def test_an_index_needs_documents() -> None:
    with pytest.raises(ValueError, match="at least one document"):
        LexicalIndex([])

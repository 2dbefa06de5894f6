"""car_fl.model.features: document texts in label order, their cached embeddings, new rows."""

from __future__ import annotations

import pytest
import torch

from car_fl.data.corpus import read_documents
from car_fl.data.corpus_splits import new_document_indices
from car_fl.model.encoder import Encoder, load_encoder
from car_fl.model.feature_cache import FeatureCache
from car_fl.model.features import corpus_documents, document_features, trained_rows


def test_document_embeddings_are_cached_so_a_second_party_never_loads_the_encoder(
    make_corpus_settings,
) -> None:
    settings = make_corpus_settings()
    texts = [d.text for d in read_documents(settings.dataset.documents_path or "")]
    loads: list[int] = []

    def get_encoder() -> Encoder:
        loads.append(1)
        return load_encoder(settings.model, device="cpu")

    first = document_features(settings, texts, get_encoder=get_encoder)
    FeatureCache.clear_memory()  # a new process: only the disk cache is left
    again = document_features(settings, texts, get_encoder=get_encoder)
    assert loads == [1] and first.shape == (12, again.shape[1])
    torch.testing.assert_close(first, again)
    subset = document_features(settings, texts[:3], get_encoder=get_encoder)
    assert loads == [1] and torch.equal(subset, first[:3])  # cached per text: no encoder
    other = document_features(settings, [texts[0], texts[1] + " w1"], get_encoder=get_encoder)
    assert loads == [1, 1]  # one text never seen: the encoder for it alone
    assert torch.equal(other[0], first[0]) and not torch.equal(other[1], first[1])


def test_new_documents_are_the_untrained_rows_and_other_files_are_refused(
    make_corpus_settings, tmp_path
) -> None:
    settings = make_corpus_settings()
    trained = trained_rows(settings, 12)
    assert trained is not None
    new = new_document_indices(12, new_fraction=0.25, seed=settings.seed)
    assert {int(i) for i in (~trained).nonzero().flatten()} == set(new) and len(new) == 3
    names = [d.id for d in corpus_documents(settings, [f"d{i}" for i in range(12)])]
    assert names == [f"d{i}" for i in range(12)]
    with pytest.raises(ValueError, match="not the 11 documents this model was trained on"):
        corpus_documents(settings, names[:11])

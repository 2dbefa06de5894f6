"""car_fl.model.retriever: a retriever's start depends on the settings and the corpus only."""

from __future__ import annotations

import pytest
import torch

from car_fl.data.corpus import read_documents
from car_fl.model.retriever import build_retriever


def test_the_start_depends_on_the_seed_alone_and_cached_features_need_no_encoder(
    make_settings,
) -> None:
    settings = make_settings("approach=car")
    first = build_retriever(settings, 3, hidden_size=64)
    again = build_retriever(settings, 3, hidden_size=64)
    assert not first.has_encoder  # classifier mode on cached features: nothing loaded
    for name, value in first.trainable_state_dict().items():
        assert torch.equal(value, again.trainable_state_dict()[name])
    other = build_retriever(make_settings("approach=car", "seed=1"), 3, hidden_size=64)
    assert not torch.equal(
        other.trainable_state_dict()["head.classifier.weight"],
        first.trainable_state_dict()["head.classifier.weight"],
    )


def test_each_head_gets_what_it_starts_from(make_corpus_settings) -> None:
    settings = make_corpus_settings("approach=fusion", "model.standardize=documents")
    documents = [d.text for d in read_documents(settings.dataset.documents_path or "")]
    model = build_retriever(settings, len(documents), hidden_size=64, documents=documents)
    assert model.standardizer.fitted and model.lexical is not None
    assert model.head.has_documents
    with pytest.raises(ValueError, match="needs the documents"):
        build_retriever(settings, len(documents), hidden_size=64)

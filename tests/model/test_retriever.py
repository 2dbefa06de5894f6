"""The retriever: which parameters get gradients in each mode, what a state dict holds, and
retrieval from a checkpoint (load_retriever, retrieve) for each head kind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from car_fl.heads.scorer import ClassifierScorer
from car_fl.model.encoder import load_encoder
from car_fl.model.retriever import CaRRetriever
from car_fl.privacy.mechanism import ADAPTER_WEIGHT, split_adapter
from car_fl.settings.schema import HeadConfig, Mode, ModelConfig


@pytest.fixture
def encoder(tiny_llama: Path):
    return load_encoder(ModelConfig(name="t", name_or_path=str(tiny_llama)), device="cpu")


def backward_once(model: CaRRetriever) -> None:
    ids, mask = model.encoder.pad(model.encoder.tokenize(["w1 k1 w2", "k2"]).input_ids)
    _, loss = model(ids, mask, labels=torch.tensor([0, 1]))
    assert loss is not None
    loss.backward()


def test_only_adapter_and_head_require_gradients(encoder) -> None:
    model = CaRRetriever(
        encoder, 3, head=HeadConfig(pre_classifier_dim=8), mode=Mode.ADAPTER_CLASSIFIER
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        "adapter.weight",
        "head.pre_classifier.weight",
        "head.pre_classifier.bias",
        "head.classifier.weight",
        "head.classifier.bias",
    }
    # the privacy package's one name for it (DP-SGD's per-part clipping, local DP's parts)
    assert split_adapter(model.trainable_parameters())[0] == (ADAPTER_WEIGHT,)


def test_adapter_mode_gradient_reaches_adapter_but_no_encoder_weight(encoder) -> None:
    model = CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER)
    backward_once(model)
    grad = model.adapter.get_parameter("weight").grad
    assert grad is not None and grad.abs().sum() > 0
    assert all(p.grad is None for p in model.encoder.parameters())


def test_classifier_mode_adapter_gets_no_gradient(encoder) -> None:
    model = CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.CLASSIFIER)
    assert not model.adapter.weight.requires_grad
    backward_once(model)
    assert model.adapter.get_parameter("weight").grad is None
    assert model.head.classifier.weight.grad is not None  # type: ignore[union-attr]
    assert all(p.grad is None for p in model.encoder.parameters())


def test_trainable_state_dict_holds_only_trained_tensors(encoder) -> None:
    clf = CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.CLASSIFIER)
    adp = CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER)
    assert list(clf.trainable_state_dict()) == ["head.classifier.weight", "head.classifier.bias"]
    assert list(adp.trainable_state_dict()) == [
        "adapter.weight",
        "head.classifier.weight",
        "head.classifier.bias",
    ]
    d = encoder.hidden_size
    assert adp.trainable_state_dict()["adapter.weight"].shape == (d, d)


def test_load_trainable_state_dict_round_trip_and_errors(encoder) -> None:
    a = CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER)
    b = CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER)
    with torch.no_grad():
        a.adapter.get_parameter("weight").add_(0.5)
    b.load_trainable_state_dict(a.trainable_state_dict())
    for name, value in a.trainable_state_dict().items():
        assert torch.equal(value, b.trainable_state_dict()[name])
    state = a.trainable_state_dict()
    del state["head.classifier.bias"]
    with pytest.raises(ValueError, match=r"missing \['head.classifier.bias'\]"):
        b.load_trainable_state_dict(state)
    state = a.trainable_state_dict()
    state["head.classifier.weight"] = torch.zeros(4, encoder.hidden_size)
    with pytest.raises(ValueError, match=r"head.classifier.weight.*shape \(4, 64\)"):
        b.load_trainable_state_dict(state)


def test_trainable_parameters_are_whatever_requires_a_gradient(encoder) -> None:
    model = CaRRetriever(encoder, 3, head=HeadConfig(pre_classifier_dim=8), mode=Mode.CLASSIFIER)
    assert isinstance(model.head, ClassifierScorer) and model.head.pre_classifier is not None
    model.head.pre_classifier.requires_grad_(False)
    assert list(model.trainable_parameters()) == ["head.classifier.weight", "head.classifier.bias"]
    model.adapter.requires_grad_(True)
    assert list(model.trainable_parameters()) == [
        "adapter.weight",
        "head.classifier.weight",
        "head.classifier.bias",
    ]


def test_retrieve_needs_the_label_names(encoder) -> None:
    model = CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.CLASSIFIER)
    with pytest.raises(RuntimeError, match="needs the labels"):
        model.retrieve(["k1"], 1)
    with pytest.raises(ValueError, match="2 names and 3 documents for 3 labels"):
        model.set_labels(["a", "b"], ["a", "b", "c"])
    model.set_labels(["a", "b", "c"], ["doc a", "doc b", "doc c"])
    [result] = model.retrieve(["k1"], 3)
    assert sorted(result.labels) == ["a", "b", "c"]
    assert result.documents == tuple(f"doc {name}" for name in result.labels)

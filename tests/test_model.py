"""Trainable parts: which parameters get gradients in each mode, and what a state dict holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from car_fl.config import HeadConfig, ModelConfig
from car_fl.encoder import load_encoder
from car_fl.model import CaRRetriever


@pytest.fixture
def encoder(tiny_llama: Path):  # type: ignore[no-untyped-def]
    return load_encoder(ModelConfig(name="t", name_or_path=str(tiny_llama)), device="cpu")


def backward_once(model: CaRRetriever) -> None:
    ids, mask = model.encoder.pad(model.encoder.tokenize(["w1 k1 w2", "k2"]).input_ids)
    _, loss = model(ids, mask, labels=torch.tensor([0, 1]))
    assert loss is not None
    loss.backward()


def test_only_adapter_and_head_require_gradients(encoder) -> None:  # type: ignore[no-untyped-def]
    model = CaRRetriever(
        encoder, 3, head=HeadConfig(pre_classifier_dim=8), mode="adapter+classifier"
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        "adapter.weight",
        "head.pre_classifier.weight",
        "head.pre_classifier.bias",
        "head.classifier.weight",
        "head.classifier.bias",
    }


def test_adapter_mode_gradient_reaches_adapter_but_no_encoder_weight(encoder) -> None:  # type: ignore[no-untyped-def]
    model = CaRRetriever(encoder, 3, head=HeadConfig(), mode="adapter+classifier")
    backward_once(model)
    assert model.adapter.weight.grad is not None
    assert model.adapter.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.encoder.parameters())


def test_classifier_mode_adapter_gets_no_gradient(encoder) -> None:  # type: ignore[no-untyped-def]
    model = CaRRetriever(encoder, 3, head=HeadConfig(), mode="classifier")
    assert not model.adapter.weight.requires_grad
    backward_once(model)
    assert model.adapter.weight.grad is None
    assert model.head.classifier.weight.grad is not None
    assert all(p.grad is None for p in model.encoder.parameters())


def test_trainable_state_dict_holds_only_trained_tensors(encoder) -> None:  # type: ignore[no-untyped-def]
    clf = CaRRetriever(encoder, 3, head=HeadConfig(), mode="classifier")
    adp = CaRRetriever(encoder, 3, head=HeadConfig(), mode="adapter+classifier")
    assert list(clf.trainable_state_dict()) == ["head.classifier.weight", "head.classifier.bias"]
    assert list(adp.trainable_state_dict()) == [
        "adapter.weight",
        "head.classifier.weight",
        "head.classifier.bias",
    ]
    d = encoder.hidden_size
    assert adp.trainable_state_dict()["adapter.weight"].shape == (d, d)


def test_load_trainable_state_dict_round_trip_and_errors(encoder) -> None:  # type: ignore[no-untyped-def]
    a = CaRRetriever(encoder, 3, head=HeadConfig(), mode="adapter+classifier")
    b = CaRRetriever(encoder, 3, head=HeadConfig(), mode="adapter+classifier")
    with torch.no_grad():
        a.adapter.weight.add_(0.5)
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

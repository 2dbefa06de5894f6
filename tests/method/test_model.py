"""The retriever: which parameters get gradients in each mode, what a state dict holds, and
retrieval from a checkpoint (load_retriever, retrieve) for each head kind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from car_fl.data.labels import LabelMap
from car_fl.data.splits import load_splits
from car_fl.method.encoder import load_encoder
from car_fl.method.model import CaRRetriever, build_retriever
from car_fl.method.scorers import ClassifierScorer, KNNScorer, MIPSScorer
from car_fl.method.serving import load_retriever
from car_fl.results.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from car_fl.settings.schema import HeadConfig, HeadKind, Mode, ModelConfig, Settings


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


def test_adapter_mode_gradient_reaches_adapter_but_no_encoder_weight(encoder) -> None:
    model = CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER)
    backward_once(model)
    assert model.adapter.weight.grad is not None
    assert model.adapter.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.encoder.parameters())


def test_classifier_mode_adapter_gets_no_gradient(encoder) -> None:
    model = CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.CLASSIFIER)
    assert not model.adapter.weight.requires_grad
    backward_once(model)
    assert model.adapter.weight.grad is None
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


# ------------------------------------------------------------------ from_checkpoint, retrieve
LABELS = LabelMap(("topic0", "topic1", "topic2", "topic3"))
DOCS = [f"+dataset.label_texts.topic{i}=k{i}" for i in range(4)]
QUERIES = ["w3 k2 w4", "k0 w1", "w7 k1"]


def save(model: CaRRetriever, settings: Settings, folder: Path) -> Path:
    ckpt = Checkpoint(
        state=model.trainable_state_dict(), label_map=LABELS, settings=settings, round=1
    )
    return save_checkpoint(folder, ckpt)


def expected(model: CaRRetriever, k: int) -> tuple[list[list[str]], torch.Tensor]:
    """Top-k label names and softmax scores straight from the trained model's forward."""
    ids, mask = model.encoder.pad(model.encoder.tokenize(QUERIES).input_ids)
    with torch.no_grad():
        logits, _ = model(ids, mask)
    scores, idx = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return [[LABELS.names[i] for i in row] for row in idx.tolist()], scores


def test_from_checkpoint_retrieves_what_the_trained_classifier_scores(
    make_settings, tmp_path: Path
) -> None:
    settings = make_settings("mode=adapter", "head.pre_classifier_dim=8")
    model = build_retriever(settings, len(LABELS))
    with torch.no_grad():  # a trained state: adapter and head away from their initialisation
        model.adapter.weight.add_(0.05 * torch.randn_like(model.adapter.weight))
        assert isinstance(model.head, ClassifierScorer)
        model.head.classifier.weight.mul_(3.0)
    folder = save(model, settings, tmp_path / "ckpt")
    retriever = load_retriever(folder, device="cpu")
    assert retriever.kind is HeadKind.CLASSIFIER and retriever.label_names == LABELS.names
    results = retriever.retrieve(QUERIES, 3)
    labels, scores = expected(model, 3)
    assert [list(r.labels) for r in results] == labels
    torch.testing.assert_close(torch.tensor([r.scores for r in results]), scores)
    assert all(r.documents == r.labels for r in results)  # no label_texts: the names
    assert retriever.retrieve([], 3) == []


def test_from_checkpoint_gives_mips_its_documents_through_the_trained_adapter(
    make_settings, tmp_path: Path
) -> None:
    settings = make_settings("head.kind=mips", "mode=adapter", "head.similarity=cosine", *DOCS)
    documents = [f"k{i}" for i in range(4)]
    model = build_retriever(settings, len(LABELS), documents=documents)
    with torch.no_grad():
        model.adapter.weight.add_(0.1 * torch.randn_like(model.adapter.weight))
    folder = save(model, settings, tmp_path / "ckpt")
    assert list(load_checkpoint(folder).state) == ["adapter.weight"]
    retriever = load_retriever(folder, device="cpu")
    assert isinstance(retriever.head, MIPSScorer)
    results = retriever.retrieve(QUERIES, 2)
    labels, scores = expected(model, 2)
    assert [list(r.labels) for r in results] == labels
    torch.testing.assert_close(torch.tensor([r.scores for r in results]), scores)
    assert [r.documents for r in results] == [
        tuple(documents[LABELS.index(name)] for name in row) for row in labels
    ]


def test_from_checkpoint_rebuilds_the_knn_memory_from_the_training_split(
    make_settings, tmp_path: Path
) -> None:
    settings = make_settings("head.kind=knn", "head.knn_k=1", "head.similarity=cosine")
    folder = save(build_retriever(settings, len(LABELS)), settings, tmp_path / "ckpt")
    assert load_checkpoint(folder).state == {}
    retriever = load_retriever(folder, device="cpu")
    splits = load_splits(settings.dataset, seed=settings.seed, label_map=LABELS)
    assert isinstance(retriever.head, KNNScorer) and retriever.head.memory is not None
    assert len(retriever.head.memory) == len(splits.train)
    texts, ids = splits.train["text"][:12], splits.train["label"][:12]
    results = retriever.retrieve(texts, 1)  # a training text's nearest example is itself
    assert [r.labels[0] for r in results] == [LABELS.names[i] for i in ids]


def test_a_knn_checkpoint_whose_training_data_is_gone_says_what_it_needs(
    make_settings, tmp_path: Path
) -> None:
    data = tmp_path / "gone.tsv"
    data.write_text("".join(f"topic{i % 4}\tk{i % 4} w{i}\n" for i in range(40)))
    settings = make_settings("head.kind=knn", f"dataset.path={data}")
    folder = save(build_retriever(settings, len(LABELS), hidden_size=8), settings, tmp_path / "c")
    data.unlink()
    with pytest.raises(FileNotFoundError, match=r"kNN checkpoint.*gone\.tsv.*could not be read"):
        load_retriever(folder, device="cpu")


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

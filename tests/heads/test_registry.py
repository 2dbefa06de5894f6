"""The heads by kind: one scorer each, its state, its scores by hand, its use in the retriever."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from car_fl.heads import scorer as registry
from car_fl.heads.config import HEADS
from car_fl.heads.document_head import DocumentHead
from car_fl.heads.experts import MixtureHead
from car_fl.heads.retrieval import KNNScorer, MIPSScorer, knn_scores
from car_fl.heads.scorer import ClassifierHead, ClassifierScorer, build_scorer, scorer_class
from car_fl.model.encoder import Encoder, load_encoder
from car_fl.model.retriever import CaRRetriever
from car_fl.settings.schema import HeadConfig, HeadKind, Mode, ModelConfig, Similarity


@pytest.fixture
def encoder(tiny_llama: Path) -> Encoder:
    return load_encoder(ModelConfig(name_or_path=str(tiny_llama)), device="cpu")


def test_every_head_kind_has_one_scorer_and_its_traits() -> None:
    assert list(HEADS) and set(HEADS) == set(HeadKind)
    scorers = {kind: scorer_class(kind) for kind in HeadKind}
    assert all(scorer.kind is kind for kind, scorer in scorers.items())
    assert len(set(scorers.values())) == len(scorers)
    # the traits agree with what the built scorers are: weights, documents, experts, memory
    for kind, scorer in scorers.items():
        assert kind.traits.from_documents == issubclass(scorer, DocumentHead), kind
        assert kind.traits.experts == issubclass(scorer, MixtureHead), kind
        assert kind.traits.memory == hasattr(scorer, "set_memory"), kind
        if kind is not HeadKind.MOE:  # a mixture needs its layout to be built
            built = build_scorer(HeadConfig(kind=kind), dim=4, num_labels=3)
            assert kind.traits.weights == any(True for _ in built.parameters()), kind


def test_a_head_with_a_0_d_parameter_is_refused_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    class Scalar(ClassifierScorer):
        def __init__(self, dim: int, num_labels: int, **kwargs: object) -> None:
            super().__init__(dim, num_labels)
            self.scale = torch.nn.Parameter(torch.tensor(1.0))

    monkeypatch.setattr(registry, "scorer_class", lambda kind: Scalar)
    with pytest.raises(TypeError, match=r"'scale' is 0-d.*give it shape \(1,\)"):
        build_scorer(HeadConfig(), dim=4, num_labels=3)


def test_a_registration_that_names_no_scorer_of_its_kind_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A registration's ``module:Class`` is read only when a head is built: one that names
    another kind's scorer, or no scorer at all, is refused there, naming it."""
    for wrong in ("car_fl.heads.retrieval:MIPSScorer", "car_fl.heads.clustering:ExpertLayout"):
        spec = HEADS[HeadKind.CLASSIFIER]._replace(scorer=wrong)
        monkeypatch.setitem(HEADS, HeadKind.CLASSIFIER, spec)
        with pytest.raises(TypeError, match=f"{wrong} is no Scorer of kind classifier"):
            build_scorer(HeadConfig(), dim=4, num_labels=3)


def test_each_head_kind_builds_its_own_scorer() -> None:
    cases = {
        HeadKind.CLASSIFIER: ClassifierScorer,
        HeadKind.MIPS: MIPSScorer,
        HeadKind.KNN: KNNScorer,
    }
    for kind, cls in cases.items():
        scorer = build_scorer(HeadConfig(kind=kind), dim=4, num_labels=3)
        assert type(scorer) is cls and scorer.kind is kind
    # only the classifier has weights
    assert [n for n, _ in build_scorer(HeadConfig(), dim=4, num_labels=3).named_parameters()] == [
        "classifier.weight",
        "classifier.bias",
    ]
    assert not list(build_scorer(HeadConfig(kind=HeadKind.MIPS), dim=4, num_labels=3).parameters())
    assert not list(build_scorer(HeadConfig(kind=HeadKind.KNN), dim=4, num_labels=3).parameters())


def test_the_classifier_scorer_is_the_classifier_head_with_the_same_initialisation() -> None:
    torch.manual_seed(5)
    head = ClassifierHead(6, 3, pre_classifier_dim=4)
    torch.manual_seed(5)
    scorer = build_scorer(HeadConfig(pre_classifier_dim=4), dim=6, num_labels=3)
    assert list(scorer.state_dict()) == list(head.state_dict())
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in scorer.state_dict().items())
    x = torch.randn(5, 6)
    assert torch.equal(scorer(x), head(x))
    assert scorer.index(lambda ids: torch.zeros(0), adapted=True) is None


def test_mips_scores_against_document_features_by_hand() -> None:
    scorer = MIPSScorer(3, similarity=Similarity.DOT, temperature=0.5)
    with pytest.raises(RuntimeError, match="needs its label documents"):
        scorer.index(lambda ids: torch.zeros(0), adapted=False)
    with pytest.raises(ValueError, match="2 label documents for 3 labels"):
        scorer.set_document_features(torch.zeros(2, 2))
    scorer.set_document_features(torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    docs = scorer.index(lambda ids: torch.zeros(0), adapted=False)
    q = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    assert torch.equal(scorer(q, docs), torch.tensor([[4.0, 0.0, 2.0], [12.0, 8.0, 14.0]]))
    with pytest.raises(ValueError, match="need the label documents"):
        scorer(q)


def test_mips_encodes_its_documents_once_when_frozen_and_every_time_when_adapted() -> None:
    calls: list[list[list[int]]] = []

    def encode(ids: list[list[int]]) -> torch.Tensor:
        calls.append(ids)
        return torch.tensor([[float(len(i)), 1.0] for i in ids], requires_grad=True) * 1

    scorer = MIPSScorer(2, similarity=Similarity.DOT, temperature=1.0)
    scorer.set_documents([[1, 2], [3]])
    frozen = scorer.index(encode, adapted=False)
    assert torch.equal(scorer.index(encode, adapted=False), frozen)
    assert len(calls) == 1 and not frozen.requires_grad  # kept, without a graph
    adapted = scorer.index(encode, adapted=True)
    scorer.index(encode, adapted=True)
    assert len(calls) == 3 and adapted.requires_grad  # through the adapter: re-encoded
    assert calls[-1] == [[1, 2], [3]]


def test_knn_scorer_holds_its_memory_and_votes_like_knn_scores() -> None:
    scorer = KNNScorer(3, k=2, similarity=Similarity.COSINE)
    q = torch.tensor([[1.0, 0.1], [0.0, 1.0]])
    with pytest.raises(RuntimeError, match="needs its memory"):
        scorer(q)
    with pytest.raises(ValueError, match="3 memory rows for 2 labels"):
        scorer.set_memory(torch.zeros(3, 2), torch.tensor([0, 1]))
    memory = torch.tensor([[1.0, 0.0], [0.9, 0.2], [0.0, 1.0], [0.1, 0.9]])
    labels = torch.tensor([0, 0, 1, 2])
    scorer.set_memory(memory, labels)
    expected = knn_scores(q, memory, labels, 3, k=2, kind=Similarity.COSINE)
    assert torch.equal(scorer(q), expected)
    assert scorer(q).argmax(dim=1).tolist() == [0, 1]


def test_the_retriever_scores_with_its_scorer(encoder: Encoder) -> None:
    knn = CaRRetriever(
        encoder, 3, head=HeadConfig(kind=HeadKind.KNN, knn_k=1), mode=Mode.CLASSIFIER
    )
    memory, labels = torch.randn(6, encoder.hidden_size), torch.tensor([0, 1, 2, 0, 1, 2])
    knn.set_memory(memory, labels)
    assert isinstance(knn.head, KNNScorer) and knn.head.memory is not None
    assert knn.score(memory).argmax(dim=1).tolist() == labels.tolist()  # nearest: itself
    with pytest.raises(TypeError, match="for a MIPS head, not knn"):
        knn.set_documents(["a", "b", "c"])
    clf = CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.CLASSIFIER)
    with pytest.raises(TypeError, match="for a kNN head, not classifier"):
        clf.set_memory(memory, labels)


def test_mips_head_has_no_classifier_and_trains_only_the_adapter(encoder: Encoder) -> None:
    frozen = CaRRetriever(encoder, 2, head=HeadConfig(kind=HeadKind.MIPS), mode=Mode.CLASSIFIER)
    assert isinstance(frozen.head, MIPSScorer) and not list(frozen.head.parameters())
    assert frozen.trainable_parameters() == {}
    trained = CaRRetriever(
        encoder, 2, head=HeadConfig(kind=HeadKind.MIPS), mode=Mode.ADAPTER_CLASSIFIER
    )
    assert list(trained.trainable_parameters()) == ["adapter.weight"]
    trained.set_documents(["k0", "k1"])
    ids, mask = encoder.pad(encoder.tokenize(["w1 k0", "k1 w2 w3"]).input_ids)
    _, loss = trained(ids, mask, labels=torch.tensor([0, 1]))
    assert loss is not None
    loss.backward()
    assert trained.adapter.weight.grad is not None
    assert all(p.grad is None for p in encoder.model.parameters())
    with pytest.raises(ValueError, match="3 label documents for 2 labels"):
        trained.set_documents(["a", "b", "c"])

"""Retrieval functions by hand (MIPS, cosine, kNN votes, metrics); each approach learns the task.

The scorers that hold each method's state are tested in test_scorers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from car_fl.centralized import run_centralized
from car_fl.heads.retrieval import knn_scores, mips_scores, similarity
from car_fl.model.features import label_documents
from car_fl.settings.compose import load_settings
from car_fl.settings.schema import Similarity
from car_fl.testing.tiny import synthetic_examples, write_tsv
from car_fl.training.train import rank_metrics
from car_fl.training.train import rank_of_true as ranks

DOCS = [f"+dataset.label_texts.topic{i}=k{i}" for i in range(4)]


def test_label_documents_fall_back_to_the_label_name() -> None:
    assert label_documents(["ham", "spam", "x"], {"ham": "personal", "x": ""}) == [
        "personal",
        "spam",
        "x",
    ]


def test_mips_and_cosine_by_hand() -> None:
    q = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    d = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert torch.equal(mips_scores(q, d), torch.tensor([[2.0, 0.0, 1.0], [6.0, 4.0, 7.0]]))
    assert torch.equal(mips_scores(q, d, temperature=0.5), 2 * mips_scores(q, d))
    cos = similarity(q, d, Similarity.COSINE)
    r = 2**-0.5
    expected = torch.tensor([[1.0, 0.0, r], [0.6, 0.8, 7 * r / 5]])
    assert torch.allclose(cos, expected, atol=1e-6)
    # MIPS with unnormalised vectors prefers long documents; cosine does not
    assert int(mips_scores(q[:1], d).argmax()) == 0
    assert int(similarity(torch.tensor([[1.0, 1.0]]), d, Similarity.COSINE).argmax()) == 2


def test_knn_votes_then_nearest_similarity_by_hand() -> None:
    memory = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.2, 0.8]])
    labels = torch.tensor([0, 0, 1, 1, 1])
    q = torch.tensor([[1.0, 0.0]])
    # k=3: neighbours by inner product 1.0 (0), 0.9 (0), 0.2 (1) -> votes 2 and 1
    scores = knn_scores(q, memory, labels, 3, k=3)
    assert scores[0, 0] > scores[0, 1] > scores[0, 2]
    assert torch.allclose(scores[0, :2].floor(), torch.tensor([2.0, 1.0]))
    # label 2 has no example: it ranks last, below a label with no vote
    assert scores[0, 2] < 0
    # k=5: votes 2 vs 3, label 1 wins even though label 0 holds the nearest example
    assert int(knn_scores(q, memory, labels, 3, k=5).argmax()) == 1
    # equal votes (k=2 on a query between the classes): the nearest example decides
    mid = torch.tensor([[0.5, 0.55]])
    tie = knn_scores(mid, memory[[0, 2]], labels[[0, 2]], 2, k=2)
    assert torch.allclose(tie.floor(), torch.tensor([[1.0, 1.0]]))
    assert int(tie.argmax()) == 1


def test_mips_metrics_by_hand() -> None:
    """Top-K and MRR of MIPS scores against ranks worked out on paper."""
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    d = torch.tensor([[3.0, 0.0], [0.0, 2.0], [1.0, 1.5]])
    # scores: [3, 0, 1], [0, 2, 1.5], [3, 2, 2.5]; true labels 2, 1, 1 -> ranks 2, 1, 3
    m = rank_metrics(ranks(mips_scores(q, d), torch.tensor([2, 1, 1])), top_k=[2])
    assert m["top1"] == pytest.approx(1 / 3)
    assert m["top2"] == pytest.approx(2 / 3)
    assert m["mrr"] == pytest.approx((1 / 2 + 1 + 1 / 3) / 3)


def test_knn_with_adapter_mode_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"head.kind=knn trains nothing.*mode=classifier"):
        load_settings(["head.kind=knn", "mode=adapter"])


@pytest.fixture(scope="module")
def easy_tsv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Short texts (keyword plus at most one filler): a frozen random encoder separates them."""
    examples = synthetic_examples(400, fillers=(0, 1), seed=3)
    return write_tsv(tmp_path_factory.mktemp("easy") / "easy.tsv", examples)


@pytest.mark.parametrize(
    ("approach", "extra", "floor"),
    [
        ("mips", ["head.similarity=cosine"], 0.9),
        ("knn", ["head.similarity=cosine", "head.knn_k=5"], 0.9),
        ("car", ["train.lr=1e-2"], 0.9),
        ("adapter_mips", ["head.similarity=cosine", "head.temperature=0.1"], 0.9),
        ("adapter_car", ["train.lr=1e-2"], 0.9),
    ],
)
@pytest.mark.slow
def test_each_retrieval_head_learns_the_synthetic_task(
    approach: str,
    extra: list[str],
    floor: float,
    tmp_path: Path,
    tiny_bert: Path,
    easy_tsv: Path,
) -> None:
    settings = load_settings(
        [
            "model=local",
            f"model.name_or_path={tiny_bert}",
            "model.pooling=mean",
            f"dataset.path={easy_tsv}",
            *DOCS,
            f"approach={approach}",
            "train.epochs=4",
            f"cache_dir={tmp_path / 'cache'}",
            "progress=false",
            "device=cpu",
            *extra,
        ]
    )
    summary = run_centralized(settings, tmp_path / approach)
    assert summary["final"]["test_top1"] >= floor, summary["final"]
    trains = approach not in ("mips", "knn")
    assert summary["epochs"] == (4 if trains else 0)
    assert summary["head"] == settings.head.kind

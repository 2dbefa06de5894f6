"""car_fl.heads.fusion and approach=fusion: the head's ranking fused with BM25's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from car_fl.data.corpus import read_documents
from car_fl.data.splits import load_splits
from car_fl.heads.fusion import competition_ranks, reciprocal_rank_fusion
from car_fl.heads.lexical import LexicalIndex
from car_fl.model.retriever import build_retriever
from car_fl.serving.checkpoint import load_retriever
from car_fl.standalone.centralized import run_centralized


def test_tied_scores_share_one_rank() -> None:
    scores = torch.tensor([[3.0, 0.0, 5.0, 0.0, 3.0]])
    assert competition_ranks(scores).tolist() == [[2, 4, 1, 4, 2]]


def test_fusion_adds_reciprocal_ranks_and_needs_rankings_of_one_shape() -> None:
    head = torch.tensor([[9.0, 8.0, 7.0]])  # ranks 1 2 3
    lexical = torch.tensor([[0.0, 2.0, 1.0]])  # ranks 3 1 2
    fused = reciprocal_rank_fusion(head, lexical, k=1)
    expected = torch.tensor([[1 / 2 + 1 / 4, 1 / 3 + 1 / 2, 1 / 4 + 1 / 3]], dtype=fused.dtype)
    torch.testing.assert_close(fused, expected)
    assert int(fused.argmax()) == 1  # second in one ranking and first in the other wins
    first, second = torch.tensor([[3.0, 2.0, 1.0]]), torch.tensor([[1.0, 2.0, 3.0]])
    swapped = reciprocal_rank_fusion(first, second)  # 0 and 2 sum alike: the first ranking
    assert competition_ranks(swapped).tolist() == [[1, 3, 2]]  # decides, no tie is left
    unretrieved = torch.tensor([[float("-inf"), 2.0, 1.0]])  # the first: not retrieved
    torch.testing.assert_close(
        reciprocal_rank_fusion(unretrieved, k=1),
        torch.tensor([[0.0, 1 / 2, 1 / 3]], dtype=fused.dtype),
    )
    weighted = reciprocal_rank_fusion(head, lexical, k=1, weights=(0.0, 1.0))
    assert int(weighted.argmax()) == 1 and weighted[0, 0] < weighted[0, 2]  # the lexical order
    with pytest.raises(ValueError, match="as many weights >= 0"):
        reciprocal_rank_fusion(head, lexical, weights=(1.0,))
    with pytest.raises(ValueError, match="cannot be fused"):
        reciprocal_rank_fusion(head, lexical[:, :2])
    with pytest.raises(ValueError, match="k must be >= 1"):
        reciprocal_rank_fusion(head, k=0)


def test_fusion_needs_a_corpus_and_a_document_head(make_settings, make_corpus_settings) -> None:
    with pytest.raises(ValueError, match="approach=fusion on a corpus"):
        make_settings("head.lexical=bm25")
    with pytest.raises(ValueError, match="approach=fusion on a corpus"):
        make_corpus_settings("approach=mips", "head.lexical=bm25")
    assert make_corpus_settings("approach=fusion").approach == "fusion"


def test_fusion_ranks_the_test_queries_by_the_head_and_bm25_and_serves_the_same(
    make_corpus_settings, tmp_path: Path
) -> None:
    """Round 0 (the untrained document head) fused with BM25 by hand gives the run's test
    metrics; the head alone is cosine MIPS; the checkpoint serves the fused ranking."""
    settings = make_corpus_settings("approach=fusion", "train.epochs=1")
    summary = run_centralized(settings, tmp_path / "run")
    mips = run_centralized(
        make_corpus_settings("approach=mips", "head.similarity=cosine"), tmp_path / "mips"
    )
    splits = load_splits(settings.dataset, seed=settings.seed)
    texts, labels = list(splits.test["text"]), torch.tensor(splits.test["label"])
    documents = [d.text for d in read_documents(settings.dataset.documents_path or "")]
    start = build_retriever(settings, len(documents), documents=documents).eval()
    with torch.no_grad():
        ids = start.encoder.tokenize(texts).input_ids
        head = start.score(start.encode(*start.encoder.pad(ids)))
    lexical = LexicalIndex(documents).scores(texts)
    fused = reciprocal_rank_fusion(head, lexical.masked_fill(lexical == 0, float("-inf")))
    assert summary["initial"]["test_top1"] == pytest.approx(
        float((fused.argmax(1) == labels).double().mean())
    )
    assert mips["best"]["test_top1"] == pytest.approx(
        float((head.argmax(1) == labels).double().mean())
    )
    # BM25 finds these queries' document words; the untrained head does not
    assert summary["initial"]["test_top1"] > mips["best"]["test_top1"]
    best = load_retriever(tmp_path / "run" / "checkpoints" / "best")
    assert best.lexical is not None
    hit = best.retrieve([texts[0]], k=3)[0]
    assert hit.score_kind == "rrf" and hit.probabilities is None
    added = best.add_documents(["late"], ["zz9 a paper that arrived late"])  # BM25 knows it
    assert best.retrieve(["zz9"], k=1)[0].labels == ("late",) and len(added) == 1


@pytest.mark.slow
def test_fusion_federates_the_head_and_the_server_ranks_by_both(
    make_corpus_settings, tmp_path: Path
) -> None:
    """Two clients train the document head (nothing of the index travels); the server's
    evaluation fuses, and starts where the centralised run starts."""
    from car_fl.simulation.in_process import run_local

    common = ("approach=fusion", "train.epochs=1")
    central = run_centralized(make_corpus_settings(*common), tmp_path / "central")
    out = tmp_path / "fl"
    settings = make_corpus_settings(
        *common, "fl.clients=2", "fl.rounds=2", "fl.local_epochs=1", f"output_dir={out}"
    )
    metrics = run_local(settings)
    summary = metrics["summary"]
    assert summary["initial"]["test_top1"] == pytest.approx(central["initial"]["test_top1"])
    assert [row["round"] for row in metrics["history"] if row["round"] > 0] == [1, 2]
    best = load_retriever(out / "checkpoints" / "best")
    assert best.lexical is not None and set(best.trainable_state_dict()) == {
        name for name in best.trainable_state_dict() if name.startswith("head.")
    }

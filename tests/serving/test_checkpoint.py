"""car_fl.serving.checkpoint: a retriever from a checkpoint, for each head kind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from car_fl.data.labels import LabelMap
from car_fl.data.splits import load_splits
from car_fl.heads.retrieval import KNNScorer, MIPSScorer
from car_fl.heads.scorer import ClassifierScorer
from car_fl.model.retriever import CaRRetriever, build_retriever
from car_fl.results.run import Checkpoint, load_checkpoint, save_checkpoint
from car_fl.serving.checkpoint import checkpoint_extra, load_retriever
from car_fl.settings.schema import HeadKind, Settings

LABELS = LabelMap(("topic0", "topic1", "topic2", "topic3"))
DOCS = [f"+dataset.label_texts.topic{i}=k{i}" for i in range(4)]
QUERIES = ["w3 k2 w4", "k0 w1", "w7 k1"]


def save(model: CaRRetriever, settings: Settings, folder: Path) -> Path:
    ckpt = Checkpoint(
        state=model.trainable_state_dict(), label_map=LABELS, settings=settings, round=1
    )
    return save_checkpoint(folder, ckpt)


def expected(model: CaRRetriever, k: int) -> tuple[list[list[str]], torch.Tensor, torch.Tensor]:
    """Top-k label names, logits and softmax probabilities straight from the model's forward."""
    ids, mask = model.encoder.pad(model.encoder.tokenize(QUERIES).input_ids)
    with torch.no_grad():
        logits, _ = model(ids, mask)
    scores, idx = logits.float().topk(k, dim=-1)
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, idx)
    return [[LABELS.names[i] for i in row] for row in idx.tolist()], scores, probs


def test_load_retriever_retrieves_what_the_trained_classifier_scores(
    make_settings, tmp_path: Path
) -> None:
    settings = make_settings("mode=adapter", "head.pre_classifier_dim=8")
    model = build_retriever(settings, len(LABELS))
    with torch.no_grad():  # a trained state: adapter and head away from their initialisation
        model.adapter.get_parameter("weight").add_(
            0.05 * torch.randn_like(model.adapter.get_parameter("weight"))
        )
        assert isinstance(model.head, ClassifierScorer)
        model.head.classifier.weight.mul_(3.0)
    folder = save(model, settings, tmp_path / "ckpt")
    retriever = load_retriever(folder, device="cpu")
    assert retriever.kind is HeadKind.CLASSIFIER and retriever.label_names == LABELS.names
    results = retriever.retrieve(QUERIES, 3)
    labels, scores, probs = expected(model, 3)
    assert [list(r.labels) for r in results] == labels
    assert all(r.score_kind == "logit" for r in results)
    torch.testing.assert_close(torch.tensor([r.scores for r in results]), scores)  # logits
    torch.testing.assert_close(torch.tensor([r.probabilities for r in results]), probs)
    assert all(r.documents == r.labels for r in results)  # no label_texts: the names
    assert retriever.retrieve([], 3) == []


def test_load_retriever_gives_mips_its_documents_through_the_trained_adapter(
    make_settings, tmp_path: Path
) -> None:
    settings = make_settings("head.kind=mips", "mode=adapter", "head.similarity=cosine", *DOCS)
    documents = [f"k{i}" for i in range(4)]
    model = build_retriever(settings, len(LABELS), documents=documents)
    with torch.no_grad():
        model.adapter.get_parameter("weight").add_(
            0.1 * torch.randn_like(model.adapter.get_parameter("weight"))
        )
    folder = save(model, settings, tmp_path / "ckpt")
    assert list(load_checkpoint(folder).state) == ["adapter.weight"]
    retriever = load_retriever(folder, device="cpu")
    assert isinstance(retriever.head, MIPSScorer)
    results = retriever.retrieve(QUERIES, 2)
    labels, scores, _ = expected(model, 2)
    assert [list(r.labels) for r in results] == labels
    # the cosine similarities themselves (forward divides them by the temperature), no softmax
    assert all(r.score_kind == "cosine" and r.probabilities is None for r in results)
    temperature = settings.head.temperature
    torch.testing.assert_close(torch.tensor([r.scores for r in results]), scores * temperature)
    assert [r.documents for r in results] == [
        tuple(documents[LABELS.index(name)] for name in row) for row in labels
    ]


@pytest.mark.slow
def test_load_retriever_rebuilds_the_knn_memory_from_the_training_split(
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


@pytest.mark.slow
def test_a_corpus_checkpoint_serves_documents_and_takes_new_ones_as_rows(
    make_corpus_settings, tmp_path: Path
) -> None:
    from car_fl.centralized import run_centralized
    from car_fl.data.corpus import read_documents

    settings = make_corpus_settings("approach=document", "train.epochs=2", "train.lr=0.01")
    run_centralized(settings, tmp_path / "run")
    folder = tmp_path / "run" / "checkpoints" / "final"
    retriever = load_retriever(folder, device="cpu")
    assert retriever.kind is HeadKind.DOCUMENT
    documents = {d.id: d.text for d in read_documents(settings.dataset.documents_path or "")}
    (result,) = retriever.retrieve(["w3 w44"], 5)
    assert [h.id for h in result.hits] == list(result.labels)
    assert all(h.text == documents[h.id] for h in result.hits)  # each hit's own text
    assert sorted((h.score for h in result.hits), reverse=True) == [h.score for h in result.hits]
    before = retriever.retrieve(QUERIES, 12)
    added = retriever.add_documents(["new0"], ["k3 w77 w78"])
    assert list(added) == [12]
    after = retriever.retrieve(QUERIES, 13)
    for old, new in zip(before, after, strict=True):  # softmax scores renormalise; ranks do not
        assert [label for label in new.labels if label != "new0"] == list(old.labels)
    (hit,) = retriever.retrieve(["w77 w78"], 1)[0].hits
    assert (hit.id, hit.text) == ("new0", "k3 w77 w78")


@pytest.mark.slow
def test_a_corpus_checkpoint_refuses_other_documents(make_corpus_settings, tmp_path: Path) -> None:
    from car_fl.centralized import run_centralized
    from car_fl.data.corpus import read_documents

    settings = make_corpus_settings("approach=document", "train.epochs=1")
    run_centralized(settings, tmp_path / "run")
    folder = tmp_path / "run" / "checkpoints" / "final"
    docs = Path(settings.dataset.documents_path or "").read_text(encoding="utf-8")
    changed = tmp_path / "changed.jsonl"
    changed.write_text(docs.replace("w3 w23", "w3 w99"), encoding="utf-8")
    assert len(read_documents(changed)) == 12
    with pytest.raises(ValueError, match=r"not those .* was trained on"):
        load_retriever(folder, device="cpu", documents_path=changed)
    with pytest.raises(FileNotFoundError, match="documents_path="):
        load_retriever(folder, device="cpu", documents_path=tmp_path / "missing.jsonl")


@pytest.mark.parametrize("kind", ["lowrank", "diagonal"])
def test_a_checkpoint_of_another_adapter_kind_loads_and_retrieves_as_trained(
    make_settings, tmp_path: Path, kind: str
) -> None:
    """The checkpoint's settings name its adapter kind: the loaded retriever builds that kind
    and scores as the trained model did."""
    settings = make_settings("mode=adapter", f"adapter.kind={kind}", "adapter.rank=4")
    model = build_retriever(settings, len(LABELS))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.adapter.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    folder = save(model, settings, tmp_path / "ckpt")
    retriever = load_retriever(folder, device="cpu")
    assert retriever.adapter.kind.value == kind and not retriever.adapter.is_identity()
    labels, scores, _ = expected(model, 3)
    results = retriever.retrieve(QUERIES, 3)
    assert [list(r.labels) for r in results] == labels
    torch.testing.assert_close(torch.tensor([r.scores for r in results]), scores)


def test_a_checkpoint_served_with_other_encoder_weights_says_so(
    make_settings, tmp_path: Path, tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The model folder a checkpoint names now holds other weights: it still loads (model=
    may name another encoder on purpose), but the log says the features are not the ones it
    was trained on."""
    model_dir = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    settings = make_settings(model_dir=model_dir)
    model = build_retriever(settings, len(LABELS))
    ckpt = Checkpoint(
        state=model.trainable_state_dict(),
        label_map=LABELS,
        settings=settings,
        round=1,
        extra=checkpoint_extra(settings, LABELS.names, model),
    )
    folder = save_checkpoint(tmp_path / "ckpt", ckpt)
    load_retriever(folder, device="cpu")
    assert "another encoder" not in caplog.text
    weights = load_file(model_dir / "model.safetensors")
    save_file({k: v * 1.01 for k, v in weights.items()}, model_dir / "model.safetensors")
    load_retriever(folder, device="cpu")
    assert f"was trained with another encoder than {model_dir} holds here" in caplog.text

"""car_fl.commands.ask: a corpus checkpoint's top-K documents, then a tiny Llama's answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from car_fl.centralized import run_centralized
from car_fl.cli import main


@pytest.fixture
def corpus_checkpoint(make_corpus_settings, tmp_path: Path) -> tuple[str, str]:
    settings = make_corpus_settings("approach=document", "train.epochs=1")
    run_centralized(settings, tmp_path / "run")
    return str(tmp_path / "run" / "checkpoints" / "final"), settings.dataset.documents_path or ""


def test_ask_answers_from_the_top_k_documents_and_names_them(
    corpus_checkpoint: tuple[str, str],
    tiny_generator: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt, documents = corpus_checkpoint
    common = ["--checkpoint", ckpt, "--documents", documents, "--device", "cpu", "-k", "3"]
    assert main(["retrieve", *common, "--json", "w5 w47"]) == 0
    [retrieved] = json.loads(capsys.readouterr().out)
    ask = ["ask", *common, "--generator", str(tiny_generator), "--max-new-tokens", "5"]
    assert main([*ask, "--json", "w5 w47"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["question"] == "w5 w47" and payload["answer"].strip()
    assert [s["id"] for s in payload["sources"]] == [h["id"] for h in retrieved["results"]]
    assert [s["text"] for s in payload["sources"]] == [h["text"] for h in retrieved["results"]]
    assert main([*ask, "w5 w47"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == payload["answer"]  # greedy: the same answer
    assert lines[2] == "Sources:"
    assert [line.split()[1] for line in lines[3:]] == [s["id"] for s in payload["sources"]]


def test_a_bad_generator_or_k_is_one_line_and_a_non_zero_exit(
    corpus_checkpoint: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, _ = corpus_checkpoint
    missing = tmp_path / "no-such-model"
    args = ["ask", "--checkpoint", ckpt, "--generator", str(missing), "--device", "cpu", "w5"]
    assert main(args) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"car-fl ask: could not load the generator '{missing}'")
    assert "config.json" in line
    assert main(["ask", "--checkpoint", ckpt, "--generator", str(missing), "-k", "0", "w5"]) == 1
    assert "car-fl ask: -k must be >= 1" in capsys.readouterr().err


@pytest.fixture
def causal_checkpoint(make_corpus_settings, tiny_generator: Path, tmp_path: Path) -> str:
    """A document-head checkpoint whose frozen encoder is the tiny causal Llama itself."""
    settings = make_corpus_settings(
        "approach=document", "train.epochs=1", f"model.name_or_path={tiny_generator}"
    )
    run_centralized(settings, tmp_path / "run")
    return str(tmp_path / "run" / "checkpoints" / "final")


@pytest.mark.slow
def test_same_model_answers_with_one_copy_of_the_weights_as_two_copies_do(
    causal_checkpoint: str,
    tiny_generator: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from car_fl.serving.checkpoint import load_retriever
    from car_fl.serving.rag import load_generator

    generator = load_generator(str(tiny_generator), device="cpu")
    shared = load_retriever(
        causal_checkpoint, device="cpu", encoder=generator.as_encoder(_model(causal_checkpoint))
    )
    assert shared.encoder.model is generator.model.get_decoder()  # one copy in memory
    separate = load_retriever(causal_checkpoint, device="cpu")
    assert separate.encoder.model is not generator.model.get_decoder()
    question = ["w5 w47"]
    assert [h.id for h in shared.retrieve(question, 3)[0].hits] == [
        h.id for h in separate.retrieve(question, 3)[0].hits
    ]
    common = ["ask", "--checkpoint", causal_checkpoint, "--device", "cpu", "--json"]
    common += ["--max-new-tokens", "4"]
    assert main([*common, "--same-model", "w5 w47"]) == 0
    one_copy = json.loads(capsys.readouterr().out)
    assert main([*common, "--generator", str(tiny_generator), "w5 w47"]) == 0
    assert json.loads(capsys.readouterr().out) == one_copy  # same documents, same answer


def _model(checkpoint: str):  # the checkpoint's encoder settings
    from car_fl.results.run import load_checkpoint

    return load_checkpoint(checkpoint).settings.model


@pytest.mark.slow
def test_same_model_and_a_generator_are_refused_together(
    causal_checkpoint: str, tiny_generator: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["ask", "--checkpoint", causal_checkpoint, "--same-model"]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--generator", str(tiny_generator), "w5"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_ask_states_its_sources_with_their_titles_even_when_the_generator_writes_nothing(
    corpus_checkpoint: tuple[str, str],
    tiny_generator: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 44, 4: where an answer came from never depends on a 135M model copying a title:
    car-fl states the retrieved documents itself, around whatever the generator writes."""
    from car_fl.serving import rag

    ckpt, documents = corpus_checkpoint
    titled = tmp_path / "documents.jsonl"  # the same documents (same digest), with titles
    rows = [json.loads(line) for line in Path(documents).read_text().splitlines()]
    titled.write_text("".join(json.dumps({**r, "title": f"On {r['id']}"}) + "\n" for r in rows))

    def silent(self: rag.Generator, question: str, hits: list, **_: object) -> rag.Answer:
        return rag.Answer(text="", sources=tuple(h.id for h in hits), prompt=question)

    monkeypatch.setattr(rag.Generator, "answer", silent)
    common = ["--checkpoint", ckpt, "--documents", str(titled), "--device", "cpu", "-k", "2"]
    ask = ["ask", *common, "--generator", str(tiny_generator)]
    assert main([*ask, "w5 w47"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "(the generator wrote no answer)" and lines[2] == "Sources:"
    sources = lines[3:]
    assert len(sources) == 2
    for line in sources:
        _rank, doc, _score, title = line.split("\t")[0].split() + line.split("\t")[1:]
        assert title == f"On {doc}"
    assert main([*ask, "--json", "w5 w47"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["answer"] == "" and [s["title"] for s in payload["sources"]] == [
        f"On {s['id']}" for s in payload["sources"]
    ]


def test_ask_refuses_a_checkpoint_of_labels_in_one_line(
    make_settings, tiny_generator: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Labels hold no text to answer from: the answer would be nonsense with the labels as
    its "sources"."""
    run_centralized(make_settings("train.epochs=1"), tmp_path / "run")
    ckpt = str(tmp_path / "run" / "checkpoints" / "final")
    assert main(["ask", "--checkpoint", ckpt, "--generator", str(tiny_generator), "w5"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"car-fl ask: {ckpt} retrieves labels (4: ")
    assert "use car-fl retrieve with it" in line

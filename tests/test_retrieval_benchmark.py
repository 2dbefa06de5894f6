"""scripts/retrieval_benchmark.py: overrides, federation flags, and a run's row (tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from car_fl.settings.compose import load_settings
from car_fl.settings.schema import DPMode
from tests.helpers import load_script


@pytest.mark.slow
def test_federation_flags_become_settings_that_compose(tiny_corpus: tuple[Path, Path]) -> None:
    bench = load_script("retrieval_benchmark")
    corpus = tiny_corpus[0].parent
    fed = bench.federation_overrides(clients=2, rounds=3, epsilon=3.0)
    settings = load_settings(
        [*bench.corpus_overrides(corpus), *bench.VARIANTS["query_map"][1], *fed]
    )
    assert (settings.fl.clients, settings.fl.min_clients, settings.fl.rounds) == (2, 2, 3)
    assert settings.dp.mode is DPMode.RECORD and settings.dp.target_epsilon == 3.0
    assert settings.head.train_rows is False
    # the benchmark's own defaults: batches of 64 and 10 % new documents
    assert settings.train.batch_size == 64 and settings.dataset.new_fraction == 0.1
    assert bench.federation_overrides(clients=None, rounds=None, epsilon=None) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clients": 0, "rounds": None, "epsilon": None}, "--clients must be >= 1, got 0"),
        ({"clients": 2, "rounds": 0, "epsilon": None}, "--rounds must be >= 1, got 0"),
        ({"clients": 2, "rounds": 1, "epsilon": -1.0}, "--dp-epsilon must be > 0"),
    ],
)
def test_bad_federation_flags_are_one_line_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_script("retrieval_benchmark").federation_overrides(**kwargs)


def test_rounds_without_clients_and_overrides_without_a_value_are_refused(
    tiny_corpus: tuple[Path, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = load_script("retrieval_benchmark")
    corpus = str(tiny_corpus[0].parent)
    for args, message in (
        (["--rounds", "2"], "--rounds and --dp-epsilon need --clients"),
        (["train.epochs"], "overrides are KEY=VALUE, got train.epochs"),
    ):
        with pytest.raises(SystemExit):
            bench.main(["--corpus", corpus, "--out", str(tmp_path), *args])
        assert message in capsys.readouterr().err


def test_overrides_after_only_are_overrides_and_an_unknown_variant_is_named(
    tiny_corpus: tuple[Path, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = load_script("retrieval_benchmark")
    assert bench.split_only(["moe", "moe.eval_route=12", "knn"]) == (
        ["moe", "knn"],
        ["moe.eval_route=12"],
    )
    assert bench.split_only(None) == (None, [])
    with pytest.raises(SystemExit):
        bench.main(
            ["--corpus", str(tiny_corpus[0].parent), "--out", str(tmp_path), "--only", "mpis"]
        )
    assert "unknown variant mpis; valid: mips, document_untrained" in capsys.readouterr().err


@pytest.mark.slow
def test_a_variant_run_reports_its_starting_point_beside_the_selected_model(
    tiny_corpus: tuple[Path, Path], tiny_llama: Path, tmp_path: Path
) -> None:
    bench = load_script("retrieval_benchmark")
    corpus = tiny_corpus[0].parent
    model = ["model=local", f"model.name_or_path={tiny_llama}", "train.epochs=1"]
    row = bench.run_variant("query_map", corpus, tmp_path, model)
    assert row["selected"] in (0, 1) and row["start_test_recall@10"] is not None
    if row["selected"] == 0:
        assert row["test_recall@10"] == row["start_test_recall@10"]
    fed = bench.run_variant(
        "query_map",
        corpus,
        tmp_path / "fl",
        [*bench.federation_overrides(clients=2, rounds=1, epsilon=None), *model],
        federate=True,
    )
    assert fed["federated"] and fed["clients"] == 2 and fed["start_test_recall@10"] is not None


def test_the_bm25_row_is_bm25_alone_and_fusion_starts_from_mips_and_bm25(
    tiny_corpus: tuple[Path, Path], tiny_llama: Path, tmp_path: Path
) -> None:
    """On the tiny corpus every query holds a word of its document only: BM25 alone finds it
    first, and fusing it with the untrained head (cosine MIPS) beats that head."""
    bench = load_script("retrieval_benchmark")
    corpus = tiny_corpus[0].parent
    model = ["model=local", f"model.name_or_path={tiny_llama}", "dataset.new_fraction=0"]
    bm25 = bench.run_variant("bm25", corpus, tmp_path, model)
    assert bm25["test_recall@1"] == 1.0 and bm25["head_flops"] == 0
    mips = bench.run_variant("mips", corpus, tmp_path, model)
    fused = bench.run_variant("fusion_untrained", corpus, tmp_path, model)
    assert mips["test_recall@1"] < fused["test_recall@1"] <= bm25["test_recall@1"]

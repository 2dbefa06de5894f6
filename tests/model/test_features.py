"""Feature preparation: the content-keyed cache, extraction order, LocalData, training split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from car_fl.data.splits import load_splits
from car_fl.model import encoder as encoder_module
from car_fl.model.features import (
    FeatureCache,
    LocalData,
    extract_features,
    length_batches,
    prepare_data,
)
from car_fl.model.retriever import build_retriever
from car_fl.serving.checkpoint import training_features
from car_fl.settings.schema import Mode


@pytest.mark.slow
def test_cached_classifier_features_do_not_load_the_encoder(make_settings) -> None:
    settings = make_settings()
    splits = load_splits(settings.dataset, seed=settings.seed)
    texts, labels = splits.train["text"], splits.train["label"]
    model = build_retriever(settings, len(splits.label_map))
    cache = FeatureCache(settings.cache_dir)
    common = dict(
        mode=Mode.CLASSIFIER, model_cfg=settings.model, device="cpu", batch_size=16, progress=False
    )
    first = prepare_data(texts, labels, get_model=lambda: model, cache=cache, **common)
    FeatureCache.clear_memory()  # a new process: only the disk cache is left
    loads = encoder_module.LOAD_COUNT

    def must_not_load():
        raise AssertionError("the encoder was loaded although every feature was cached")

    second = prepare_data(
        texts, labels, get_model=must_not_load, cache=FeatureCache(settings.cache_dir), **common
    )
    assert loads == encoder_module.LOAD_COUNT
    assert first.features is not None and second.features is not None
    assert torch.equal(first.features, second.features)
    changed = prepare_data(
        [*texts[:-1], texts[-1] + " w1"], labels, get_model=lambda: model, cache=cache, **common
    )
    assert changed.features is not None
    assert not torch.equal(changed.features[-1], first.features[-1])


def test_bucketed_extraction_returns_features_in_the_original_order(make_settings) -> None:

    settings = make_settings("model.pooling=eos")
    model = build_retriever(settings, 4)
    texts = ["w1", "w1 w2 w3 w4 w5 w6 w7", "k1 w2", "w9 w8 w7 w6", "k3"] * 3
    ids = model.encoder.tokenize(texts).input_ids
    kwargs: dict[str, Any] = {"batch_size": 4, "progress": False}
    bucketed = extract_features(model.encode, model.encoder.pad, ids, bucket=True, **kwargs)
    arrival = extract_features(model.encode, model.encoder.pad, ids, bucket=False, **kwargs)
    one_by_one = torch.cat([model.encode(*model.encoder.pad([s])).detach() for s in ids])
    torch.testing.assert_close(bucketed, arrival, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bucketed, one_by_one, rtol=1e-5, atol=1e-5)


def test_length_batches_cover_each_index_once_longest_first() -> None:
    lengths = [3, 9, 1, 9, 5, 2, 7]
    batches = length_batches(lengths, 3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert [lengths[i] for b in batches for i in b] == sorted(lengths, reverse=True)
    assert [len(b) for b in batches] == [3, 3, 1]


def test_local_data_needs_features_or_ids_of_the_right_length() -> None:
    labels = torch.tensor([0, 1, 1])
    with pytest.raises(ValueError, match="needs features or input_ids"):
        LocalData(labels=labels)
    with pytest.raises(ValueError, match="2 feature rows for 3 labels"):
        LocalData(labels=labels, features=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="1 token sequences for 3 labels"):
        LocalData(labels=labels, input_ids=[[1, 2]])
    assert len(LocalData(labels=labels, input_ids=[[1], [2], [3]])) == 3


def test_the_disk_cache_round_trips_per_text_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    features = torch.randn(5, 4)
    texts = [f"text {i}" for i in range(5)]
    FeatureCache(tmp_path).put("space", texts, features)
    [chunk] = (tmp_path / "features" / "space").iterdir()
    assert chunk.suffix == ".safetensors" and chunk.stat().st_mode & 0o777 == 0o600
    FeatureCache.clear_memory()  # a new process: only the disk is left
    fresh = FeatureCache(tmp_path)
    got, missing = fresh.lookup("space", [texts[3], "never seen", texts[0]])
    assert missing == [1] and got is not None
    assert torch.equal(got[0], features[3]) and torch.equal(got[2], features[0])
    assert fresh.lookup("another space", texts) == (None, [0, 1, 2, 3, 4])


def test_only_texts_no_chunk_holds_are_encoded_once_each(tmp_path: Path) -> None:
    encoded: list[list[str]] = []

    def compute(texts: list[str]) -> torch.Tensor:  # a stand-in encoder: one row per text
        encoded.append(list(texts))
        return torch.tensor([[float(len(t)), float(sum(map(ord, t)))] for t in texts])

    cache = FeatureCache(tmp_path)
    first = cache.features("s", ["a", "bb", "a"], compute)
    assert encoded == [["a", "bb"]] and (cache.hits, cache.misses) == (0, 2)
    FeatureCache.clear_memory()
    again = FeatureCache(tmp_path)  # another list: a shard of other texts and known ones
    second = again.features("s", ["ccc", "bb", "a"], compute)
    assert encoded[1:] == [["ccc"]] and (again.hits, again.misses) == (2, 1)
    assert torch.equal(second[1:], torch.stack([first[1], first[0]]))
    assert torch.equal(second, compute(["ccc", "bb", "a"]))
    assert again.features("s", ["a", "ccc"], compute).shape == (2, 2) and len(encoded) == 3


def test_rows_of_a_space_the_encoder_left_on_loading_are_not_mixed_with_its_own(
    tmp_path: Path,
) -> None:
    """Loading the encoder moved its space (a Hub branch moved on download): the rows cached
    under the old space are computed again, and the new rows are kept under the new one."""
    cache = FeatureCache(tmp_path)
    cache.put("old", ["a"], torch.zeros(1, 2))
    spaces, calls = ["old"], []

    def compute(texts: list[str]) -> torch.Tensor:
        calls.append(texts)
        spaces[0] = "new"  # what loading the encoder did
        return torch.ones(len(texts), 2)

    got = cache.features(lambda: spaces[0], ["a", "b"], compute)
    assert calls == [["b"], ["a"]] and torch.equal(got, torch.ones(2, 2))
    assert cache.lookup("new", ["a", "b"])[1] == []  # both kept under the new space


def test_an_unreadable_cache_file_is_a_miss_not_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "features" / "space"
    folder.mkdir(parents=True)
    (folder / "bad.safetensors").write_bytes(b"not a safetensors file")
    FeatureCache.clear_memory()
    cache = FeatureCache(tmp_path)
    assert cache.lookup("space", ["a"]) == (None, [0])
    feats = cache.features("space", ["a"], lambda texts: torch.ones(len(texts), 3))
    assert torch.equal(feats, torch.ones(1, 3)) and (cache.hits, cache.misses) == (0, 1)


def test_training_features_are_the_training_split_with_the_given_label_ids(
    make_settings,
) -> None:
    settings = make_settings()
    splits = load_splits(settings.dataset, seed=settings.seed)
    model = build_retriever(settings, len(splits.label_map))
    data = training_features(settings, splits.label_map, get_model=lambda: model)
    assert data.labels.tolist() == list(splits.train["label"])
    assert data.features is not None and data.features.shape == (len(splits.train), 64)
    first = model.encode(
        *model.encoder.pad(model.encoder.tokenize([splits.train["text"][0]]).input_ids)
    )
    torch.testing.assert_close(data.features[0], first[0].detach(), rtol=1e-5, atol=1e-5)


def test_every_setting_that_changes_a_feature_changes_its_space() -> None:
    import dataclasses

    from car_fl.model.feature_cache import space_key
    from car_fl.settings.schema import ModelConfig

    base = ModelConfig(name="local", name_or_path="/nowhere", dtype="float32")
    changes: dict[str, Any] = {
        "pooling": "mean",
        "layer": 3,
        "prompt": 'This sentence : "{text}" means in one word:"',
        "normalize": "l2",
        "max_length": 64,
        "dtype": "bfloat16",
    }
    keys = {space_key(base, device="cpu")}
    for field, value in changes.items():
        keys.add(space_key(dataclasses.replace(base, **{field: value}), device="cpu"))
    assert len(keys) == 1 + len(changes)


def test_the_attention_kernels_are_part_of_the_space(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on a CPU loads eager attention; features cached with SDPA (before that choice, or
    with another kernel) are not mixed with them."""
    from car_fl.model import feature_cache
    from car_fl.settings.schema import ModelConfig

    cfg = ModelConfig(name="local", name_or_path="/nowhere", dtype="bfloat16")
    eager = feature_cache.space_key(cfg, device="cpu")
    monkeypatch.setattr(feature_cache, "attention_choice", lambda *_: "sdpa")
    assert feature_cache.space_key(cfg, device="cpu") != eager


def test_a_hub_models_space_follows_the_commit_its_revision_names_in_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``main`` moved to another commit: the features of the old weights are not reused."""
    from car_fl.model.feature_cache import space_key
    from car_fl.settings.schema import ModelConfig

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    cfg = ModelConfig(name="hub", name_or_path="org/model", revision="main", dtype="float32")
    repo, keys = tmp_path / "models--org--model", [space_key(cfg, device="cpu")]  # not cached
    (repo / "refs").mkdir(parents=True)
    for commit in ("1" * 40, "2" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs" / "main").write_text(commit)
        keys += [space_key(cfg, device="cpu"), space_key(cfg, device="cpu")]
    assert len(set(keys)) == 3 and keys[1] == keys[2] and keys[3] == keys[4]

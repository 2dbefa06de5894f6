"""What Flower hands car-fl: run config, node config (its one table), the fingerprint."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from car_fl.settings.compose import (
    NODE_CONFIG,
    NODE_LOCAL_KEYS,
    RUN_CONFIG,
    RUN_CONFIG_KEYS,
    NodeInfo,
    apply_node_config,
    fingerprint,
    group_options,
    is_setting,
    load_settings,
    run_config_from_args,
    run_inputs,
    settings_from_run_config,
    settings_to_yaml,
)


def test_node_info_rejects_a_client_count_mismatch(make_settings) -> None:
    settings = make_settings("fl.clients=2")
    assert NodeInfo.from_node_config(
        {"partition-id": 1, "num-partitions": 2}, settings
    ) == NodeInfo(1, 2)
    with pytest.raises(ValueError, match=r"num-partitions=3.*fl.clients=2.*num-supernodes=2"):
        NodeInfo.from_node_config({"partition-id": 0, "num-partitions": 3}, settings)
    with pytest.raises(ValueError, match=r"no 'partition-id'.*--node-config"):
        NodeInfo.from_node_config({}, settings)
    with pytest.raises(ValueError, match=r"partition-id=2 is outside \[0, 2\)"):
        NodeInfo.from_node_config({"partition-id": 2, "num-partitions": 2}, settings)


def test_data_is_shard_comes_from_the_node_config(make_settings) -> None:
    settings = make_settings()
    node = NodeInfo.from_node_config(
        {"partition-id": 0, "num-partitions": 2, "data-is-shard": "true"}, settings
    )
    assert node.data_is_shard
    assert not NodeInfo.from_node_config(
        {"partition-id": 0, "num-partitions": 2}, settings
    ).data_is_shard


def test_every_node_config_key_sets_its_setting_and_none_enters_the_fingerprint() -> None:
    settings = load_settings("dataset.path=/data/a.tsv")
    values = {"device": "cpu", "blocks": "remote"}  # a value the schema accepts for each
    node_config = {
        key: values.get(key, f"/node/{key}") for key, spec in NODE_CONFIG.items() if spec.setting
    }
    local = apply_node_config(settings, node_config)
    for key, spec in NODE_CONFIG.items():
        if spec.setting is None:
            continue
        section, _, name = spec.setting.rpartition(".")
        holder = getattr(local, section) if section else local
        assert getattr(holder, name) == node_config[key], key
        assert spec.setting in NODE_LOCAL_KEYS, key
    assert fingerprint(local) == fingerprint(settings)
    # every other setting counts: a shared value changes the fingerprint
    assert fingerprint(load_settings("dataset.path=/data/a.tsv seed=7")) != fingerprint(settings)
    # empty values leave the run's setting alone
    assert apply_node_config(settings, {"data-path": ""}).dataset.path == "/data/a.tsv"


def test_node_local_keys_name_real_settings() -> None:
    from car_fl.settings.schema import Settings

    top = {f.name for f in fields(Settings)}
    settings = Settings()
    for key in NODE_LOCAL_KEYS:
        section, _, name = key.rpartition(".")
        holder = getattr(settings, section) if section else settings
        assert section in top or (not section and name in top), key
        assert hasattr(holder, name), key


def test_run_config_overrides_or_a_whole_settings_yaml() -> None:
    composed = settings_from_run_config({"overrides": "mode=adapter fl.rounds=3"})
    assert (composed.train.mode, composed.fl.rounds) == ("adapter+classifier", 3)
    assert settings_from_run_config({}) == load_settings()
    # a whole settings YAML takes precedence over the overrides
    text = settings_to_yaml(load_settings("seed=7"))
    assert settings_from_run_config({"settings": text, "overrides": "seed=9"}).seed == 7
    with pytest.raises(ValueError, match="string of Hydra overrides"):
        settings_from_run_config({"overrides": 3})
    with pytest.raises(ValueError, match="must be YAML text"):
        settings_from_run_config({"settings": 3})


PROJECT = Path(__file__).resolve().parents[2]


def test_pyproject_run_config_holds_exactly_car_fls_keys_all_empty() -> None:
    from flwr.common.config import flatten_dict, get_project_config

    config = flatten_dict(get_project_config(PROJECT)["tool"]["flwr"]["app"]["config"])
    assert list(config) == list(RUN_CONFIG_KEYS)
    assert set(config.values()) == {""}  # "" keeps conf/'s value: one source of defaults
    # Every key's target is a setting or a config group.
    for spec in RUN_CONFIG.values():
        assert is_setting(spec.target) or spec.target in group_options(), spec.target


def test_run_config_fl_rounds_sets_the_rounds_as_flower_parses_it() -> None:
    run_config = run_config_from_args(PROJECT, ["fl.rounds=2"])
    assert settings_from_run_config(run_config).fl.rounds == 2
    assert settings_from_run_config(run_config_from_args(PROJECT, [])) == load_settings()
    several = run_config_from_args(
        PROJECT, ['fl.rounds=3 dp="record" epsilon=4 mode="adapter"', 'overrides="seed=7"']
    )
    settings = settings_from_run_config(several)
    assert (settings.fl.rounds, settings.dp.mode, settings.dp.target_epsilon) == (3, "record", 4)
    assert (settings.train.mode, settings.seed) == ("adapter+classifier", 7)
    spaced = settings_from_run_config({"dataset.path": "/data/my file's.tsv"})
    assert spaced.dataset.path == "/data/my file's.tsv"


def test_an_unknown_run_config_key_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'fl.round' .*did you mean fl.rounds\? the keys: fl"):
        run_config_from_args(PROJECT, ["fl.round=2"])
    with pytest.raises(ValueError, match=r"train.lr is a setting: give it in overrides"):
        settings_from_run_config({"train.lr": 0.1})
    with pytest.raises(ValueError, match=r"strings need double quotes"):
        run_config_from_args(PROJECT, ["mode=adapter"])
    with pytest.raises(ValueError, match=r"give dp.target_epsilon as epsilon"):
        run_config_from_args(PROJECT, ['dp="record" dp.target_epsilon=3'])
    with pytest.raises(ValueError, match=r"fl.rounds is set twice"):
        settings_from_run_config({"fl.rounds": 2, "overrides": "fl.rounds=3"})


def test_a_nodes_settings_cache_key_follows_the_run_config_keys() -> None:
    from car_fl.client.node_cache import settings_key

    def key(run_config: dict[str, object]) -> str:
        return settings_key(run_inputs(run_config)[1], {})

    # the same settings by either route share an entry; other values do not
    assert key({"fl.rounds": 2, "overrides": ""}) == key({"overrides": "fl.rounds=2"})
    assert key({"fl.rounds": 2}) != key({"fl.rounds": 3}) != key({})
    assert key({"fl.rounds": "", "overrides": ""}) == key({})


@pytest.mark.parametrize(
    "overrides", ["hydra.searchpath=[file:///tmp/x] approach=mips", "+hydra.job.chdir=true"]
)
def test_a_run_config_may_not_set_hydras_own_options(overrides: str) -> None:
    # hydra.searchpath would have every node compose configuration files of the server's
    with pytest.raises(ValueError, match="may not set Hydra's own options"):
        run_inputs({"overrides": overrides})


@pytest.mark.parametrize(
    "run_config",
    [
        {"overrides": "+experiment=../../../tmp/x"},
        {"overrides": "approach=../dp/fixed"},
        {"overrides": "dp=choice(fixed,none)"},
        {"overrides": "model/../x=minilm"},
        {"overrides": "experiment='../sms_mips'"},
        {"overrides": "~experiment"},
        {"model": "../../.."},
    ],
)
def test_a_run_config_names_a_groups_config_never_a_file(run_config: dict[str, str]) -> None:
    # a path as a group's option composes a YAML of the server's choice on every node
    with pytest.raises(ValueError, match=r"a run config names a config, never a file"):
        run_inputs(run_config)
    names = {"overrides": "dp=fixed approach=mips +experiment=[sms_mips] dataset.path=/d/x.tsv"}
    assert "approach=mips" in run_inputs({**names, "model": "minilm"})[1]


@pytest.mark.parametrize(
    "run_config",
    [
        {"overrides": "dataset.path=${oc.env:HOME}/data.tsv"},
        {"dataset.path": "${oc.env:HOME}"},
        {"overrides": "model.name_or_path=${package_model_dir:this}"},
        {"settings": "seed: ${oc.env:SEED}\n"},
    ],
)
def test_a_run_config_may_not_hold_interpolations_resolved_on_the_nodes(
    run_config: dict[str, str],
) -> None:
    # the server's run config would read a node's environment or import a module by name
    with pytest.raises(ValueError, match="may not hold an interpolation"):
        run_inputs(run_config)

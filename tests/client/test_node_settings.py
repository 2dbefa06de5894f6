"""car_fl.client.node_settings: the run's settings with the node's paths, checked and cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from car_fl.client import node_settings as node_settings_module
from car_fl.client.node_settings import node_settings
from car_fl.settings.compose import load_settings, settings_to_yaml
from car_fl.settings.flower import fingerprint


def test_node_config_paths_apply_and_fingerprints_must_match(make_settings, tmp_path: Path) -> None:
    settings = make_settings()
    run_config = {"settings": settings_to_yaml(settings)}
    local = node_settings(
        run_config,
        {"data-path": str(tmp_path / "mine.tsv"), "device": "cpu"},
        fingerprint(settings),
    )
    assert local.dataset.path == str(tmp_path / "mine.tsv")
    assert fingerprint(local) == fingerprint(settings)  # node-local paths do not count
    other = {"settings": settings_to_yaml(make_settings("fl.rounds=9"))}
    with pytest.raises(ValueError, match=r"different configuration.*same --run-config"):
        node_settings(other, {}, fingerprint(settings))


def test_node_settings_compose_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_settings_module, "_IN_PROCESS", {})
    calls: list[object] = []
    real = node_settings_module.settings_from_run_config

    def counting(run_config):
        calls.append(run_config)
        return real(run_config)

    monkeypatch.setattr(node_settings_module, "settings_from_run_config", counting)
    run_config = {"settings": settings_to_yaml(load_settings("fl.rounds=3"))}
    node = {"partition-id": 0, "cache-dir": str(tmp_path)}
    first = node_settings(run_config, node, None)
    first.fl.rounds = 99  # a copy: the caller may change it
    assert node_settings(run_config, dict(node), None).fl.rounds == 3
    assert len(calls) == 1
    # another node config (or another run) is another entry
    node_settings(run_config, {**node, "partition-id": 1}, None)
    assert len(calls) == 2

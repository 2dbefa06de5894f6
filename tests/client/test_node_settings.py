"""car_fl.client.node: the run's settings with the node's paths, checked and cached."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from car_fl.client import node as node_settings_module
from car_fl.client.failures import Refusal
from car_fl.client.node import node_settings, server_commit
from car_fl.client.round import shard_data
from car_fl.protocol.failures import Failure
from car_fl.settings.compose import NodeInfo, fingerprint, load_settings, settings_to_yaml


@pytest.mark.slow
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


def test_a_train_message_without_the_servers_fingerprint_is_refused() -> None:
    # the node would train on whatever it composed, values the server never stated
    run_config = {"settings": settings_to_yaml(load_settings("fl.rounds=3"))}
    with pytest.raises(ValueError, match="states no configuration fingerprint"):
        node_settings(run_config, {}, None)


def test_node_settings_compose_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory: dict = {}
    calls: list[object] = []
    real = node_settings_module.settings_from_run_config

    def counting(run_config):
        calls.append(run_config)
        return real(run_config)

    monkeypatch.setattr(node_settings_module, "settings_from_run_config", counting)
    settings = load_settings("fl.rounds=3")
    run_config, server = {"settings": settings_to_yaml(settings)}, fingerprint(settings)
    node = {"partition-id": 0, "cache-dir": str(tmp_path)}
    first = node_settings(run_config, node, server, memory=memory)
    first.fl.rounds = 99  # a copy: the caller may change it
    assert node_settings(run_config, dict(node), server, memory=memory).fl.rounds == 3
    assert len(calls) == 1
    # another node config (or another run) is another entry
    node_settings(run_config, {**node, "partition-id": 1}, server, memory=memory)
    assert len(calls) == 2
    # a node without that memory (another Node, a new process) composes again
    node_settings(run_config, node, server)
    assert len(calls) == 3


def test_the_server_cannot_choose_where_a_node_writes(
    make_settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker's hole: a run config's cache_dir made the node write its training texts
    and their features into the server's folder, readable by every user."""
    server_folder = tmp_path / "server-folder"
    settings = make_settings(f"cache_dir={server_folder}")
    run_config = {"settings": settings_to_yaml(settings)}
    mine = tmp_path / "node-own-cache"
    with caplog.at_level("WARNING", logger="car_fl.client.node"):
        local = node_settings(run_config, {"cache-dir": str(mine)}, fingerprint(settings))
    assert local.cache_dir == str(mine)
    assert "cache_dir" in caplog.text and "is ignored" in caplog.text
    assert mine.stat().st_mode & 0o777 == 0o700  # the owner's only
    # without a cache-dir of its own, the node's default (its owner's home), never the server's
    default = node_settings(run_config, {"device": "cpu"}, fingerprint(settings))
    assert default.cache_dir is not None and Path(default.cache_dir) != server_folder
    # a whole round: nothing lands in the server's folder, everything the node wrote is 0600
    shard_data(local, NodeInfo(partition_id=0, num_partitions=2))
    assert not server_folder.exists()
    written = [p for p in mine.rglob("*") if p.is_file()]
    assert written and all(p.stat().st_mode & 0o777 == 0o600 for p in written)


def test_a_run_runs_a_model_repositorys_code_only_where_the_node_says_so(
    make_settings, tmp_path: Path
) -> None:
    """model.trust_remote_code from the server would run code of its choice as the node's
    owner (a worker's reviewed checkout included): refused unless the node's own config says
    trust-remote-code=true, before any model is loaded."""
    settings = make_settings("model.trust_remote_code=true")
    run_config = {"settings": settings_to_yaml(settings)}
    node = {"cache-dir": str(tmp_path / "cache")}
    with pytest.raises(Refusal, match="trust-remote-code=true") as err:
        node_settings(run_config, node, fingerprint(settings))
    assert err.value.failure is Failure.POLICY_REFUSED
    mine = node_settings(run_config, {**node, "trust-remote-code": True}, fingerprint(settings))
    assert mine.model.trust_remote_code is True


def test_a_node_loads_the_servers_commit_of_a_hub_model_and_nothing_of_the_servers_choosing(
    make_settings, tmp_path: Path
) -> None:
    """The server's ``main`` is one commit, a node's cache may hold another from before: the
    node loads the server's. Only a commit is taken, and only for a Hub model the run names:
    a node's own copy (``model-path``) and a local folder stay as they are; anything but 40
    hex digits (a path, a branch) is refused before anything is read."""
    settings = make_settings()
    settings.model.name_or_path, settings.model.revision = "org/model", None
    commit = "0123456789abcdef" * 2 + "01234567"
    pinned = server_commit(settings, {}, commit)
    assert pinned.model.revision == commit and settings.model.revision is None  # a copy
    assert server_commit(settings, {}, None) is settings  # a server that names none
    own = {"model-path": str(tmp_path / "own-copy")}
    assert server_commit(settings, own, commit) is settings  # the owner's copy: the owner's
    local = make_settings()  # a folder: no commit to load
    assert server_commit(local, {}, commit).model == local.model
    for bad in ("../../etc", "main", commit.upper(), commit[:-1], commit + "0", "/" + commit[1:]):
        with pytest.raises(Refusal, match="is no commit") as err:
            server_commit(settings, {}, bad)
        assert err.value.failure is Failure.CONFIG_MISMATCH


def test_whether_a_name_is_a_hub_repository_is_read_from_its_text_never_the_nodes_disk(
    make_settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack: a server names ``secret/../../etc/ssl`` or a name too long for the file
    system; a stat of it raised (ENAMETOOLONG only when every parent exists) and made the
    round's failure code an oracle on the node's folders, before its policy. No file is looked
    at now: the outcome follows the name alone."""
    commit = "f" * 40
    base = make_settings()
    names = {
        "org/model": True,
        "secret/../../etc/ssl": False,
        "secret/" + "x" * 300: False,
        "./org/model": False,
        "gguf:smollm2": False,
        "org/model.gguf": False,
    }
    runs = {
        name: dataclasses.replace(base, model=dataclasses.replace(base.model, name_or_path=name))
        for name in names
    }

    def no_disk(*args: object, **kwargs: object) -> None:
        raise AssertionError("the node's disk was looked at")

    with monkeypatch.context() as patch:  # undone before pytest reports (it reads files)
        patch.setattr(os, "stat", no_disk)
        patch.setattr(os, "lstat", no_disk)
        got = {
            name: server_commit(run, {}, commit).model.revision == commit
            for name, run in runs.items()
        }
    assert got == names

"""A node with remote blocks: the same federation as with local ones, and the owner alone
decides where its texts go (tests that play a server pointing nodes at its own service)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from car_fl.blocks import client
from car_fl.blocks.client import IN_PROCESS
from car_fl.blocks.compute import Answer, BlocksHandler
from car_fl.client.failures import Refusal, failure_of
from car_fl.client.node import own_cache, with_environment
from car_fl.client.policy import NodePolicy
from car_fl.model import encoder
from car_fl.protocol.failures import Failure
from car_fl.simulation.in_process import run_local
from tests.blocks.conftest import URL

ADAPTER = [
    "mode=adapter",
    "model.dtype=float32",
    "fl.clients=2",
    "fl.rounds=2",
    "train.batch_size=16",
]
REMOTE = {"blocks": "remote", "blocks-service": URL}


def federate(make_settings: Any, tmp_path: Path, name: str, node_config: dict[str, Any]) -> Any:
    settings = make_settings(*ADAPTER, f"output_dir={tmp_path / name}")
    return run_local(settings, node_config=node_config)


def test_a_federated_adapter_run_equals_local_blocks(
    make_settings: Any, normed_llama: Path, tmp_path: Path, service: BlocksHandler
) -> None:
    def make(*overrides: str) -> Any:
        return make_settings(*overrides, model_dir=normed_llama)

    local = federate(make, tmp_path, "local", {})
    assert service.served == 0
    remote = federate(make, tmp_path, "remote", REMOTE)
    assert service.served > 0  # every node's blocks ran there
    mine, theirs = remote["summary"]["best"], local["summary"]["best"]
    assert mine["round"] == theirs["round"]
    assert mine["val_top1"] == theirs["val_top1"] and mine["test_top1"] == theirs["test_top1"]
    assert remote["summary"]["final"]["val_loss"] == pytest.approx(
        local["summary"]["final"]["val_loss"], abs=1e-5
    )


def test_a_service_down_fails_the_round_with_its_own_code_and_the_next_round_works(
    make_settings: Any,
    normed_llama: Path,
    tmp_path: Path,
    service: BlocksHandler,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Down for one node's round 1 (two attempts refused): that node fails the round with
    BLOCKS_UNAVAILABLE (nothing of it aggregated), and round 2 trains on both once it is back."""
    monkeypatch.setattr(client, "DEFAULT_RETRY", client.Retry(attempts=2, backoff_s=0.0))
    monkeypatch.setattr(encoder, "_SHARED", {})  # nodes connect anew, with those retries
    refused: list[str] = []

    def flaky(path: str, body: bytes, headers: dict[str, str]) -> Answer:
        if path != "/health" and len(refused) < 2:
            refused.append(path)
            raise ConnectionRefusedError(111, "Connection refused")
        return service.handle(path, body, headers)

    IN_PROCESS[URL] = flaky
    settings = make_settings(*ADAPTER, f"output_dir={tmp_path / 'down'}", model_dir=normed_llama)
    metrics = run_local(settings, node_config=REMOTE)
    first, second = metrics["history"][:2]
    assert len(refused) == 2
    assert (first["clients_ok"], first["clients_failed"]) == (1, 1)
    assert (second["clients_ok"], second["clients_failed"]) == (2, 0)
    assert any("BLOCKS_UNAVAILABLE" in r.getMessage() for r in caplog.records)


def test_the_run_config_cannot_name_a_blocks_service(make_settings: Any) -> None:
    """A server that points nodes at a service of its choice is refused before any text moves."""
    hostile = make_settings("model.blocks=remote", "model.blocks_service=http://203.0.113.9/b")
    with pytest.raises(Refusal) as err:
        own_cache(hostile, {})
    assert err.value.failure is Failure.POLICY_REFUSED
    with pytest.raises(Refusal):  # not even when the node names its own
        own_cache(hostile, {"blocks-service": "http://127.0.0.1:8200/blocks"})
    mine = own_cache(make_settings(), {**REMOTE})
    assert mine.model.blocks == "remote" and mine.model.blocks_service == URL


def test_the_owners_environment_names_a_service_where_the_node_config_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CAR_FL_BLOCKS_SERVICE", "http://127.0.0.1:8200/blocks")
    assert with_environment({})["blocks-service"] == "http://127.0.0.1:8200/blocks"
    assert with_environment({"blocks-service": URL})["blocks-service"] == URL


def test_a_policy_lists_the_services_its_texts_may_go_to(
    make_settings: Any, tmp_path: Path
) -> None:
    source = tmp_path / "policy.toml"
    listed = NodePolicy.parse(
        'modes = ["none"]\npublic-example-count = false\n'
        'blocks-services = ["http://127.0.0.1:8200/blocks"]\n',
        source=source,
    )
    silent = NodePolicy.parse('modes = ["none"]\npublic-example-count = false\n', source=source)
    settings = make_settings("model.blocks=remote")
    trusted = dataclasses.replace(
        settings,
        model=dataclasses.replace(settings.model, blocks_service=listed.blocks_services[0]),
    )
    other = dataclasses.replace(
        settings, model=dataclasses.replace(settings.model, blocks_service="http://10.0.0.9:8200/b")
    )
    assert listed.violations(trusted) == []
    assert any("blocks-services" in v for v in listed.violations(other))
    assert any("blocks-services (none)" in v for v in silent.violations(trusted))
    assert silent.violations(make_settings()) == []  # local blocks: nothing to allow


def test_an_unavailable_service_is_its_own_failure_code() -> None:
    from car_fl.blocks.errors import BlocksUnavailable

    assert failure_of(BlocksUnavailable("down")) is Failure.BLOCKS_UNAVAILABLE

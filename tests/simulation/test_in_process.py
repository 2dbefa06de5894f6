"""car_fl.simulation.in_process: the real server and ClientApp handler, nodes with their own
node config; here the malicious server against a node whose owner set a privacy policy.

Two nodes: node 1001's owner set ``privacy-policy=`` and ``data-path=`` in its node config,
node 1002 trusts the run. The server chooses the run's settings; the policy comes only from
the node's own config.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from flwr.app import Context, Message
from huggingface_hub import constants

from car_fl.client.ledger import Ledger
from car_fl.protocol.failures import Failure
from car_fl.protocol.messages import COMMIT_KEY, CONFIG_KEY
from car_fl.settings.compose import DATA_PATH, PRIVACY_POLICY
from car_fl.simulation.apps import import_app
from car_fl.simulation.in_process import LocalGrid, run_local

POLICY = """\
modes = ["fixed"]
min-noise-multiplier = 1.0
max-clip = 1.0
lifetime-epsilon = 1000
ledger = "ledger"
"""

AGREED = ("dp=fixed", "dp.noise_multiplier=2", "dp.clip=1")
ROUND = ("fl.clients=2", "fl.rounds=1", "fl.local_epochs=1")
OWNER, TRUSTING = 1001, 1002


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def owner_config(tmp_path: Path, synthetic_tsv: Path) -> dict[str, str]:
    """The owner's node config: its policy file and its own copy of its data."""
    home = tmp_path / "owner"
    home.mkdir(exist_ok=True)
    (home / "policy.toml").write_text(POLICY, encoding="utf-8")
    data = shutil.copy(synthetic_tsv, home / "data.tsv")
    return {PRIVACY_POLICY: str(home / "policy.toml"), DATA_PATH: str(data)}


def federation(settings, owner: dict[str, str]) -> tuple[dict, dict[int, Message]]:
    """One run with the real ClientApp handler; its metrics and each node's last reply."""
    real = import_app("client_app").train
    replies: dict[int, Message] = {}

    def train(msg: Message, context: Context) -> Message:
        replies[context.node_id] = reply = real(msg, context)
        return reply

    metrics = run_local(settings, client_train=train, node_configs=[owner])
    return metrics, replies


def ledger_of(owner: dict[str, str]) -> Ledger:
    return Ledger.open(Path(owner[PRIVACY_POLICY]).parent / "ledger")


@pytest.mark.slow
@pytest.mark.parametrize("weaker", [("dp=none",), (*AGREED, "dp.noise_multiplier=0.5")])
def test_the_owners_policy_refuses_a_weaker_run_and_its_node_trains_the_agreed_one(
    tmp_path: Path, make_settings, synthetic_tsv: Path, weaker: tuple[str, ...]
) -> None:
    owner = owner_config(tmp_path, synthetic_tsv)
    # The server asks for a run weaker than the owner's policy: the owner's node refuses
    refused = make_settings(*ROUND, *weaker, f"output_dir={tmp_path / 'weaker'}")
    metrics, replies = federation(refused, owner)
    assert replies[OWNER].has_error() and not replies[OWNER].has_content()  # no update left
    assert replies[OWNER].error.code == Failure.POLICY_REFUSED
    assert replies[OWNER].error.reason == Failure.POLICY_REFUSED.text  # fixed text, no detail
    assert replies[TRUSTING].has_content()  # the node without a policy trusts the run
    assert metrics["history"][0]["clients_ok"] == 1
    assert metrics["history"][0]["clients_failed"] == 1
    assert ledger_of(owner).entries() == []
    # The agreed run: the same node, the same node config, trains; its ledger lists the release
    agreed = make_settings(*ROUND, *AGREED, f"output_dir={tmp_path / 'agreed'}")
    metrics, replies = federation(agreed, owner)
    assert replies[OWNER].has_content() and replies[TRUSTING].has_content()
    assert metrics["history"][0]["clients_ok"] == 2
    entries = ledger_of(owner).entries()
    assert [(e.round, e.mode) for e in entries] == [(1, "fixed")]
    assert 0 < entries[0].epsilon < float("inf")


def test_each_node_gets_its_own_node_config_on_top_of_the_shared_one() -> None:
    grid = LocalGrid(
        import_app("client_app").train,
        num_nodes=3,
        run_config={},
        node_config={"device": "cpu"},
        node_configs=[{DATA_PATH: "a.tsv"}, {"device": "cuda"}],
    )
    configs = [grid.contexts[node].node_config for node in (1001, 1002, 1003)]
    assert [c.get(DATA_PATH) for c in configs] == ["a.tsv", None, None]
    assert [c["device"] for c in configs] == ["cpu", "cuda", "cpu"]
    assert [c["partition-id"] for c in configs] == [0, 1, 2]
    with pytest.raises(ValueError, match="2 node configs for 1 nodes"):
        LocalGrid(import_app("client_app").train, num_nodes=1, run_config={}, node_configs=[{}] * 2)


@pytest.mark.slow
def test_record_level_dp_on_a_shared_file_trains_with_the_hash_placement(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """The owner accepts dp=record on the file it shares only with each record placed by its
    own text: the run that asks for it (dataset.split=hash, fl.partitioning=hash) trains on
    both nodes, and the owner's ledger lists the release."""
    owner = owner_config(tmp_path, synthetic_tsv)
    policy = Path(owner[PRIVACY_POLICY])
    policy.write_text(
        'modes = ["record"]\nlifetime-epsilon = 1000\n[data]\nsplit = "hash"\n', encoding="utf-8"
    )
    record = (
        "dp=record",
        "dp.target_epsilon=8",
        "dp.sample_rate=0.25",
        "fl.max_examples_per_client=500",
        "dataset.split=hash",
        "fl.partitioning=hash",
    )
    settings = make_settings(*ROUND, *record, f"output_dir={tmp_path / 'run'}")
    metrics, replies = federation(settings, owner)
    assert replies[OWNER].has_content() and replies[TRUSTING].has_content()
    assert metrics["history"][0]["clients_ok"] == 2
    assert [e.mode for e in ledger_of(owner).entries()] == ["record"]


@pytest.mark.slow
def test_every_node_loads_the_commit_of_the_hub_model_the_server_loaded(
    tmp_path: Path,
    make_settings,
    tiny_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Hub model by its branch: the server sends the commit its ``main`` resolved to, and a
    node loads that commit, not its own cache's ``main``. Node 1001's message is made to name
    another commit of the repository (one without weights): that node's round fails, so it
    loaded what the message named; node 1002 trains the round on the server's."""
    hub = tmp_path / "hub"
    repo = hub / "models--org--tiny"
    good, empty = "a" * 40, "b" * 40
    shutil.copytree(tiny_llama, repo / "snapshots" / good)
    (repo / "snapshots" / empty).mkdir(parents=True)
    shutil.copy(tiny_llama / "config.json", repo / "snapshots" / empty / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(good)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))  # car-fl's reading of the cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))  # huggingface_hub's, read on import
    settings = make_settings(
        *ROUND, f"output_dir={tmp_path / 'run'}", "model.name_or_path=org/tiny"
    )
    real = import_app("client_app").train
    sent: dict[int, object] = {}
    replies: dict[int, Message] = {}

    def train(msg: Message, context: Context) -> Message:
        config = msg.content.config_records[CONFIG_KEY]
        sent[context.node_id] = config.get(COMMIT_KEY)
        if context.node_id == OWNER:
            config[COMMIT_KEY] = empty
        replies[context.node_id] = reply = real(msg, context)
        return reply

    with caplog.at_level("INFO"):
        metrics = run_local(settings, client_train=train)
    assert sent == {OWNER: good, TRUSTING: good}
    # the owner's log says what to fetch (the server sees only the fixed code)
    assert f"revision {empty} must be in the Hub cache offline" in caplog.text
    assert f"huggingface-cli download org/tiny --revision {empty}" in caplog.text
    assert replies[OWNER].error.code == Failure.ROUND_FAILED
    assert replies[TRUSTING].has_content()
    assert metrics["history"][0]["clients_ok"] == 1

"""car_fl.client.node_privacy: the malicious server against a node whose owner set a policy.

The server chooses the run's settings, the round numbers and how many runs it starts; the
node's policy and ledger come from its own disk. Each weaker run is refused before any update
leaves, the agreed run trains, and the ledger lists every release with its ε.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

from car_fl.client.failures import Refusal
from car_fl.client.node import Node
from car_fl.client.node_privacy import NodePrivacy
from car_fl.model.retriever import build_retriever
from car_fl.protocol.failures import Failure
from car_fl.protocol.messages import to_record
from car_fl.settings.compose import (
    DATA_PATH,
    PRIVACY_POLICY,
    TEST_DATA_PATH,
    NodeConfigError,
    NodeInfo,
    fingerprint,
    settings_to_yaml,
)

POLICY = """\
modes = ["fixed"]
min-noise-multiplier = 1.0
max-clip = 1.0
max-delta = 1e-5
allow-warmup = false
lifetime-epsilon = {cap}
"""

AGREED = ("dp=fixed", "dp.noise_multiplier=2", "dp.clip=1", "fl.rounds=2", "fl.local_epochs=1")
NODE = NodeInfo(partition_id=0, num_partitions=2)
#: The same node started with ``data-is-shard``: its file is its own, its split is no one else's.
SHARD = NodeInfo(partition_id=0, num_partitions=2, data_is_shard=True)


def guard(tmp_path: Path, data: Path, cap: float = 1e6) -> NodePrivacy:
    tmp_path.mkdir(parents=True, exist_ok=True)
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY.format(cap=cap), encoding="utf-8")
    return NodePrivacy.open(policy, data)


def probe_guard(tmp_path: Path, data: Path) -> NodePrivacy:
    """A ledger of another owner (another registry), for measuring what releases cost: one
    owner's second ledger over the same records is refused (one ledger per record)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CAR_FL_STATE", str(tmp_path / "probe-owner"))
        return guard(tmp_path / "probe", data)


def initial(settings) -> dict[str, torch.Tensor]:
    return build_retriever(settings, 4, hidden_size=64).trainable_state_dict()


#: The server's label map of the synthetic data (a train message always carries one).
LABELS = [f"topic{i}" for i in range(4)]


def round_of(settings, node_privacy: NodePrivacy, server_round: int, run: str = "1", place=NODE):
    return Node(config={}, privacy=node_privacy).train(
        settings, place, initial(settings), server_round, RecordDict(), LABELS, run=run
    )


def test_record_level_dp_on_a_shared_file_is_refused_without_the_hash_placement(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """The node splits and partitions the file it shares: under a seeded placement one added
    record moves hundreds of others, so the node refuses dp=record (nothing released, nothing
    charged) until its owner's [data] says split = "hash" and the run fl.partitioning=hash."""
    record = (
        "dp=record",
        "dp.target_epsilon=3",
        "dp.sample_rate=0.25",
        "fl.rounds=2",
        "fl.max_examples_per_client=500",
    )
    policy = tmp_path / "policy.toml"
    policy.write_text('modes = ["record"]\nlifetime-epsilon = 100\n', encoding="utf-8")
    node_privacy = NodePrivacy.open(policy, synthetic_tsv)
    with pytest.raises(Refusal) as err:
        round_of(make_settings(*record), node_privacy, 1)  # both read the file as seeded
    assert err.value.failure is Failure.POLICY_REFUSED and 'split = "hash"' in str(err.value)
    assert node_privacy.ledger.entries() == []
    policy.write_text(policy.read_text() + '[data]\nsplit = "hash"\n', encoding="utf-8")
    node_privacy = NodePrivacy.open(policy, synthetic_tsv)
    hashed = make_settings(*record, "dataset.split=hash", "fl.partitioning=hash")
    _, metrics = round_of(hashed, node_privacy, 1)
    assert 0 < metrics["dp-epsilon"] < math.inf and len(node_privacy.ledger.entries()) == 1


@pytest.mark.parametrize(
    "weaker",
    [
        ("dp=none",),
        ("dp.noise_multiplier=0.5",),  # σ under the floor
        ("dp.clip=1000",),  # a huge clip
        ("dp.warmup_rounds=1",),  # non-private rounds the policy does not allow
        ("dp.delta=1e-3",),
    ],
)
def test_a_weaker_run_is_refused_before_any_release(
    tmp_path: Path, make_settings, synthetic_tsv: Path, weaker: tuple[str, ...]
) -> None:
    node_privacy = guard(tmp_path, synthetic_tsv)
    with pytest.raises(Refusal) as err:
        round_of(make_settings(*AGREED, *weaker), node_privacy, 1)
    assert err.value.failure is Failure.POLICY_REFUSED
    assert node_privacy.ledger.entries() == []  # nothing was released


def test_the_agreed_run_trains_and_the_ledger_lists_every_release(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    node_privacy = guard(tmp_path, synthetic_tsv)
    settings = make_settings(*AGREED)
    state, metrics = round_of(settings, node_privacy, 1)
    assert set(state) == set(initial(settings)) and metrics["num-examples"] > 0
    round_of(settings, node_privacy, 2)
    entries = node_privacy.ledger.entries()
    assert [(e.run, e.round, e.mode) for e in entries] == [("1", 1, "fixed"), ("1", 2, "fixed")]
    assert 0 < entries[0].epsilon < entries[1].epsilon < math.inf  # composed, lifetime ε grows


def test_rounds_beyond_the_plan_and_replayed_rounds_are_refused(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    node_privacy = guard(tmp_path, synthetic_tsv)
    settings = make_settings(*AGREED)
    with pytest.raises(Refusal, match="outside the run's plan"):
        round_of(settings, node_privacy, 3)  # more rounds than fl.rounds=2
    round_of(settings, node_privacy, 1)
    with pytest.raises(Refusal, match="released once, in order"):
        round_of(settings, node_privacy, 1)  # the same round again: average the noise away
    assert len(node_privacy.ledger.entries()) == 1


def test_new_runs_cannot_pass_the_lifetime_cap(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    settings = make_settings(*AGREED)
    probe = probe_guard(tmp_path, synthetic_tsv)
    for run in ("1", "2"):
        round_of(settings, probe, 1, run=run)
    two = probe.ledger.entries()[-1].epsilon  # lifetime ε after two releases
    node_privacy = guard(tmp_path, synthetic_tsv, cap=two * 1.01)  # room for two releases
    for run in ("1", "2"):
        round_of(settings, node_privacy, 1, run=run)
    for run in ("3", "4"):  # new runs at the same round, or a resume: all refused
        with pytest.raises(Refusal) as err:
            round_of(settings, node_privacy, 1, run=run)
        assert err.value.failure is Failure.BUDGET_EXHAUSTED
    assert [e.run for e in node_privacy.ledger.entries()] == ["1", "2"]


def test_the_policy_and_ledger_come_only_from_the_node_config(
    tmp_path: Path, synthetic_tsv: Path
) -> None:
    assert NodePrivacy.from_node_config({}) is None  # no policy: today's behaviour
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY.format(cap=10), encoding="utf-8")
    with pytest.raises(NodeConfigError, match=f"no {DATA_PATH}"):
        NodePrivacy.from_node_config({PRIVACY_POLICY: str(policy)})
    found = NodePrivacy.from_node_config({PRIVACY_POLICY: str(policy), DATA_PATH: synthetic_tsv})
    assert found is not None and found.policy.lifetime_epsilon == 10


def test_a_data_file_grown_by_one_row_gives_no_old_record_a_fresh_budget(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """The attacker's hole: with the ledger keyed by the file's bytes, the owner appending a
    row (or a server waiting for it) made the old records a new data set with a fresh budget."""
    data = Path(shutil.copy(synthetic_tsv, tmp_path / "data.tsv"))
    settings = make_settings(*AGREED, f"dataset.path={data}")
    probe = probe_guard(tmp_path, data)
    round_of(settings, probe, 1)
    one = probe.ledger.entries()[-1].epsilon
    node_privacy = guard(tmp_path, data, cap=one * 1.01)  # room for one release
    round_of(settings, node_privacy, 1)
    lines = data.read_text(encoding="utf-8").splitlines(keepends=True)
    for changed in (
        [*lines, "topic0\tk0 one more message\n"],  # grown
        lines[1:],  # shrunk
        lines[::-1],  # re-ordered
    ):
        data.write_text("".join(changed), encoding="utf-8")
        with pytest.raises(Refusal) as err:
            round_of(settings, guard(tmp_path, data, cap=one * 1.01), 1, run="2")
        assert err.value.failure is Failure.BUDGET_EXHAUSTED
    assert [e.run for e in node_privacy.ledger.entries()] == ["1"]


def test_a_policy_refuses_a_run_whose_reply_would_follow_the_example_count(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """Per step, the number of noised releases (and the ε a reply carries) is ⌈n/B⌉ per
    epoch: without a public cap on n it follows the node's data."""
    node_privacy = guard(tmp_path, synthetic_tsv)
    with pytest.raises(Refusal, match="public-example-count") as err:
        node_privacy.admit(make_settings(*AGREED, "dp.granularity=step"))
    assert err.value.failure is Failure.POLICY_REFUSED
    node_privacy.admit(
        make_settings(*AGREED, "dp.granularity=step", "fl.max_examples_per_client=50")
    )


@pytest.mark.parametrize("rows", [3, 4, 5])
def test_a_message_without_a_label_map_is_refused_the_same_whatever_the_labels(
    make_settings, synthetic_tsv: Path, rows: int
) -> None:
    """The attacker's hole: with no label map the node sized its head by its own labels, so a
    head of 4 rows trained and 3 or 5 failed: the round's outcome told the label count."""
    settings = make_settings(*AGREED)
    head = build_retriever(settings, rows, hidden_size=64).trainable_state_dict()
    config = ConfigRecord({"server-round": 1, "fingerprint": fingerprint(settings)})
    content = RecordDict({"arrays": to_record(head), "config": config})
    with pytest.raises(Refusal) as err:
        Node({"partition-id": 0, "num-partitions": 2}).answer(
            content,
            run_config={"settings": settings_to_yaml(settings)},
            run="1",
        )
    assert err.value.failure is Failure.CONFIG_MISMATCH


@pytest.mark.parametrize(
    "mode",
    [
        AGREED,
        (
            "dp=record",
            "dp.target_epsilon=3",
            "dp.sample_rate=0.25",
            "fl.rounds=2",
            "fl.max_examples_per_client=500",
            "dataset.split=hash",
            "fl.partitioning=hash",
        ),
    ],
    ids=["local-dp", "dp-sgd"],
)
def test_the_run_the_server_and_the_ledger_give_the_same_releases_the_same_epsilon(
    tmp_path: Path, make_settings, synthetic_tsv: Path, mode: tuple[str, ...]
) -> None:
    """One accountant for every party: the ε a node reports for its run, the ε the server
    computes from the settings it sent, and the lifetime ε the node's ledger writes for the
    same releases (one run: every record in every release) are one number."""
    from car_fl.server.privacy_check import PrivacyCheck

    policy = tmp_path / "policy.toml"
    reading = '[data]\nsplit = "hash"\n' if "dataset.split=hash" in mode else ""
    policy.write_text(
        'modes = ["fixed", "record"]\nlifetime-epsilon = 100\n' + reading, encoding="utf-8"
    )
    node_privacy = NodePrivacy.open(policy, synthetic_tsv)
    settings = make_settings(*mode)
    check = PrivacyCheck(settings)
    node_state = RecordDict()
    for server_round in (1, 2):
        _, metrics = Node(config={}, privacy=node_privacy).train(
            settings, NODE, initial(settings), server_round, node_state, run="1"
        )
        verdict = check.receive(server_round, 7, metrics)
        ledger = node_privacy.ledger.entries()[-1].epsilon
        assert 0 < metrics["dp-epsilon"] < math.inf and verdict.mismatch == ""
        assert metrics["dp-epsilon"] == verdict.epsilon == ledger


# ------------------------------------------------- issue 41: data-dependent failure is no answer
#: Run settings the agreed policy admits whose reading of the node's file fails, or not,
#: depending on the records: a label filter (finding 1: a binary search over M recovered a
#: label's count in 9 runs) and a reader that does not fit the file.
READ_PROBES = [
    ("dataset.min_examples_per_label=1",),
    ("dataset.min_examples_per_label=1000000",),
    ("dataset=arxiv",),
]


def test_whether_the_records_can_be_read_is_no_answer_a_server_can_read(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """Finding 1: a round the policy admits failed exactly when the records failed the run's
    reading of them (a label filter, a header guess), and failing runs spent nothing. Now the
    round is charged first, and a read that fails releases noise alone: every probe gets a
    reply with the same public figures, and every one is in the ledger (a node holding its own
    shard; on a shared file a reading other than the policy's is refused outright, below)."""
    node_privacy = guard(tmp_path, synthetic_tsv)
    replies = []
    for run, probe in enumerate(READ_PROBES, start=1):
        settings = make_settings(*AGREED, *probe)
        state, metrics = round_of(settings, node_privacy, 1, run=str(run), place=SHARD)
        assert set(state) == set(initial(settings))
        assert all(bool(torch.isfinite(t).all()) for t in state.values())
        replies.append(metrics)
    assert all(reply == replies[0] for reply in replies), replies
    assert [e.run for e in node_privacy.ledger.entries()] == ["1", "2", "3"]  # all charged


def test_after_the_lifetime_budget_is_spent_every_probe_gets_budget_exhausted(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """Finding 2: the data were read before the ledger was consulted, so after the budget was
    spent a probe whose read failed got a data failure and one whose read succeeded got
    BUDGET_EXHAUSTED: the same oracle, for free, forever. Now the ledger comes first."""
    settings = make_settings(*AGREED)
    probe = probe_guard(tmp_path, synthetic_tsv)
    round_of(settings, probe, 1, run="1")
    one = probe.ledger.entries()[-1].epsilon
    node_privacy = guard(tmp_path, synthetic_tsv, cap=one * 1.01)  # room for one release
    round_of(settings, node_privacy, 1, run="1")
    for run, extra in enumerate(READ_PROBES, start=2):
        with pytest.raises(Refusal) as err:
            round_of(make_settings(*AGREED, *extra), node_privacy, 1, run=str(run), place=SHARD)
        assert err.value.failure is Failure.BUDGET_EXHAUSTED, extra
    assert [e.run for e in node_privacy.ledger.entries()] == ["1"]


def reading_probes(data: Path) -> list[tuple[str, ...]]:
    """Finding 1's reading attacks: a header guess (right and wrong) and a label filter."""
    first = data.read_text(encoding="utf-8").splitlines()[0].split("\t")[0]
    guess = (
        ("dataset=file", f"dataset.text_column={label}", f"dataset.label_column={label}")
        for label in (first, "not-" + first)
    )
    filters = (f"dataset.min_examples_per_label={m}" for m in (1, 61, 1_000_000))
    # a test file of the server's choice: its texts are dropped from training (review, issue 42)
    test_file = (f"dataset.test_path={data}",)
    return [*guess, *((f,) for f in filters), ("dataset.dedupe=false", "seed=3"), test_file]


def test_a_node_with_a_policy_reads_its_records_its_own_way_whatever_the_run_says(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """Finding 1 (issue 41): the run config chose the reader, the columns and the label
    filters, so which examples a round trained on (and, under record-level DP, how one line
    decided how the others parse) followed the records: a header guess recovered the first
    record's label, a filter over M a label's count. Now the node reads with its policy's
    [data] table: every probe trains on the very shard the agreed run trains on (a node that
    holds its own shard), or, on a shared file, is refused before any record is read and
    charged nothing (test_a_node_on_a_shared_file_refuses_a_reading_other_than_its_owners)."""
    node_privacy = guard(tmp_path, synthetic_tsv)
    shards: dict = {}
    Node(config={}, privacy=node_privacy, shards=shards).train(
        make_settings(*AGREED),
        SHARD,
        initial(make_settings(*AGREED)),
        1,
        RecordDict(),
        LABELS,
        run="1",
    )
    (own,) = shards.values()
    assert own.examples > 0
    for run, probe in enumerate(reading_probes(synthetic_tsv), start=2):
        shards.clear()
        settings = make_settings(*AGREED, *probe)
        Node(config={}, privacy=node_privacy, shards=shards).train(
            settings, SHARD, initial(settings), 1, RecordDict(), LABELS, run=str(run)
        )
        (read,) = shards.values()
        assert read.examples == own.examples, probe
        assert torch.equal(read.data.labels, own.data.labels), probe


def test_a_node_on_a_shared_file_refuses_a_reading_other_than_its_owners(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """A node reading its policy's way on a shared file trained on a split the server did not
    know: its training records could be in the server's test split (a reported test figure over
    texts a client trained on) and its partition's size was not the one the server caps counts
    by. Now every reading of the run's other than the owner's [data] is refused with
    READING_DIFFERS, before any record is read (nothing is charged); a run that reads as [data]
    says trains."""
    node_privacy = guard(tmp_path, synthetic_tsv)
    for run, probe in enumerate(reading_probes(synthetic_tsv), start=1):
        settings = make_settings(*AGREED, *probe)
        differs = node_privacy.policy.data.differences(settings, paths={"test_path": None})
        if not differs:  # the probe asks for car-fl's default: the same reading
            continue
        with pytest.raises(Refusal) as err:
            round_of(settings, node_privacy, 1, run=str(run))
        assert err.value.failure is Failure.READING_DIFFERS, probe
        assert all(key.split("=")[0] in err.value.detail for key in differs), probe
    assert node_privacy.ledger.entries() == []
    _, metrics = round_of(make_settings(*AGREED), node_privacy, 1, run="agreed")
    assert metrics["dp-epsilon"] > 0 and len(node_privacy.ledger.entries()) == 1


def test_a_test_file_named_by_the_node_alone_is_a_reading_the_server_does_not_know(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """Review: the node config's test-data-path is in the node's settings before the readings
    are compared, so a node naming a test file where the run names none was not refused: the
    server split its test records off the shared file and the node trained on them. Compared
    with the run's own files now; a node holding its own shard reads its own test file."""
    settings = make_settings(*AGREED)
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY.format(cap=1e6), encoding="utf-8")
    own_test = tmp_path / "own-test.tsv"
    own_test.write_text("topic0\ta test message of this node's own\n", encoding="utf-8")
    config = ConfigRecord(
        {"server-round": 1, "fingerprint": fingerprint(settings), "labels": LABELS}
    )
    content = RecordDict({"arrays": to_record(initial(settings)), "config": config})
    node_config = {
        PRIVACY_POLICY: str(policy),
        DATA_PATH: str(synthetic_tsv),
        TEST_DATA_PATH: str(own_test),
        "partition-id": 0,
        "num-partitions": 2,
    }
    run_config = {"settings": settings_to_yaml(settings)}
    node = Node(dict(node_config))
    with pytest.raises(Refusal) as err:
        node.answer(content, run_config=run_config, run="1")
    assert err.value.failure is Failure.READING_DIFFERS and "test_path=None" in err.value.detail
    assert node.privacy is not None and node.privacy.ledger.entries() == []
    shard = Node({**node_config, "data-is-shard": "true"})
    reply = shard.answer(content, run_config=run_config, run="1")
    assert reply.metric_records and shard.privacy is not None
    assert len(shard.privacy.ledger.entries()) == 1


def test_two_policies_cannot_keep_two_ledgers_of_the_same_records(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """Finding 4: two policy files naming the same data file kept two ledgers, each allowing
    the whole lifetime budget (a per-record ε of 46.2 against a cap of 30). One record has one
    ledger now: a second ledger over any of the same records is refused at open, naming the
    first; the same policy opens again, and a copy of the file is the same records."""
    first = guard(tmp_path / "a", synthetic_tsv)
    round_of(make_settings(*AGREED), first, 1)
    with pytest.raises(NodeConfigError, match=r"already covered by the ledger in .*a/ledger"):
        guard(tmp_path / "b", synthetic_tsv)
    copy = tmp_path / "copy.tsv"
    shutil.copy(synthetic_tsv, copy)
    with pytest.raises(NodeConfigError, match="already covered"):
        guard(tmp_path / "c", copy)
    again = guard(tmp_path / "a", copy)  # the same ledger over the same records: fine
    assert [e.run for e in again.ledger.entries()] == ["1"]
    other = tmp_path / "other.tsv"
    other.write_text("ham\ta record no other ledger covers\n", encoding="utf-8")
    guard(tmp_path / "d", other)  # disjoint records: a ledger of their own


def test_a_run_keeps_one_dp_mechanism_for_its_whole_life(make_settings) -> None:
    """Issue 41: a run id whose rounds mixed dp=record and dp=fixed reported an ε that left out
    its DP-SGD steps (the ledger counted both). A run keeps one mechanism now."""
    one_round = Node(config={}).train

    fixed = make_settings(*AGREED)
    state = RecordDict()
    one_round(fixed, NODE, initial(fixed), 1, state, LABELS)
    record = make_settings(
        "dp=record",
        "dp.target_epsilon=3",
        "dp.sample_rate=0.25",
        "fl.rounds=2",
        "fl.local_epochs=1",
        "fl.max_examples_per_client=500",
    )
    with pytest.raises(ValueError, match=r"earlier rounds used dp=fixed .* one DP mechanism"):
        one_round(record, NODE, initial(record), 2, state, LABELS)
    one_round(fixed, NODE, initial(fixed), 2, state, LABELS)  # the same mechanism goes on


def test_a_round_the_run_itself_refuses_costs_the_owner_nothing(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    """A run's own refusals that read no record (its target ε, a second mechanism) used to
    come after the ledger's charge: a server could spend a node's lifetime budget on rounds
    that release nothing. They come first now, and the ledger lists only what was released."""
    probe = probe_guard(tmp_path, synthetic_tsv)
    round_of(make_settings(*AGREED), probe, 1)
    one = probe.ledger.entries()[-1].epsilon  # a run's ε after one release (one accountant)
    policy = tmp_path / "two-modes.toml"
    policy.write_text(
        POLICY.format(cap=1e6).replace('["fixed"]', '["fixed", "adaptive"]'), encoding="utf-8"
    )
    node_privacy = NodePrivacy.open(policy, synthetic_tsv)
    node = Node(config={}, privacy=node_privacy)
    target = make_settings(*AGREED, f"dp.target_epsilon={one * 1.01}")  # room for one release
    state = RecordDict()
    node.train(target, NODE, initial(target), 1, state, LABELS, run="1")
    with pytest.raises(Refusal) as err:  # round 2 would pass the run's target
        node.train(target, NODE, initial(target), 2, state, LABELS, run="1")
    assert err.value.failure is Failure.RUN_TARGET_REACHED
    adaptive = make_settings(*AGREED, "dp=adaptive", "dp.count_noise=20")
    with pytest.raises(ValueError, match="one DP mechanism"):  # the same run, another mechanism
        node.train(adaptive, NODE, initial(adaptive), 2, state, LABELS, run="1")
    assert [(e.run, e.round) for e in node_privacy.ledger.entries()] == [("1", 1)]
    node.train(adaptive, NODE, initial(adaptive), 1, RecordDict(), LABELS, run="2")  # a new run
    assert [(e.run, e.round) for e in node_privacy.ledger.entries()] == [("1", 1), ("2", 1)]


@pytest.mark.parametrize(
    ("sent", "why"),
    [
        ({"adapter.weight": torch.eye(64)}, "are not adapter.kind=lowrank's"),  # another kind
        (
            {"adapter.up": torch.zeros(64, 65), "adapter.down": torch.zeros(64, 65)},
            r"adapter\.rank=4 must be in|has shape \(64, 65\)",
        ),
        (
            {"adapter.up": torch.zeros(64, 4), "adapter.down": torch.full((64, 4), math.inf)},
            "non-finite",  # U = 0 looks like the identity, and an infinite V poisons every step
        ),
    ],
)
def test_a_servers_ill_formed_adapter_is_refused_before_the_ledger_or_any_record(
    tmp_path: Path, make_settings, synthetic_tsv: Path, sent: dict, why: str
) -> None:
    """The malicious server's adapter: another kind than the run's, a rank the width cannot
    hold (memory), an infinite V. The node refuses it before it charges its owner's ledger or
    reads a record."""
    settings = make_settings(
        *AGREED, "approach=adapter_car", "adapter.kind=lowrank", "adapter.rank=4"
    )
    node_privacy = guard(tmp_path, synthetic_tsv)
    state = {k: v for k, v in initial(make_settings(*AGREED)).items()} | sent
    with pytest.raises(ValueError, match=why):
        Node(config={}, privacy=node_privacy).train(
            settings, NODE, state, 1, RecordDict(), LABELS, run="1"
        )
    assert node_privacy.ledger.entries() == []

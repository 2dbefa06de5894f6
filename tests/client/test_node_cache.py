"""A cached classifier round in a fresh process: what it imports, and the node's disk cache.

In deployment Flower starts a new ClientApp process for every message. Once a node has its
settings, shard and features on disk, such a process must not import transformers, datasets,
matplotlib or Hydra, nor load the encoder, and must reply exactly what a cold round replies.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from car_fl.client import node as node_settings_module
from car_fl.client import node_cache
from car_fl.data.labels import LabelMap
from car_fl.data.splits import load_splits
from car_fl.model.retriever import build_retriever
from car_fl.settings.compose import apply_node_config, conf_dir, fingerprint, load_settings
from car_fl.testing.tiny import tiny_overrides

PROJECT = Path(__file__).resolve().parents[2]
HEAVY = ("transformers", "datasets", "flwr_datasets", "matplotlib", "hydra")

# One ClientApp train message handled by the project's own handler, as Flower's ClientApp
# process does it: import the app module, build the message, call the handler, reply.
CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from safetensors.torch import load_file, save_file
import client_app
from car_fl.protocol.messages import from_record, to_record

args = json.loads(sys.argv[2])
TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
content = RecordDict({
    "arrays": to_record(load_file(args["initial"])),
    "config": ConfigRecord(
        {"server-round": 1, "fingerprint": args["fingerprint"], "labels": args["labels"]}
    ),
})
msg = Message(content=content, dst_node_id=0, message_type="train")
context = Context(run_id=1, node_id=0, node_config=args["node_config"], state=RecordDict(),
                  run_config={"overrides": args["overrides"]})
reply = client_app.train(msg, context)
save_file(from_record(reply.content.array_records["arrays"]), args["out"])
metrics = dict(reply.content.metric_records["metrics"])
print(json.dumps({"modules": sorted(sys.modules), "metrics": metrics}))
"""


def client_round(args: Mapping[str, object], out: Path) -> tuple[set[str], dict[str, float]]:
    """Run one train message in a fresh Python process; its modules and reply metrics."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(PROJECT), json.dumps({**args, "out": str(out)})],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    return {m.split(".")[0] for m in reply["modules"]}, reply["metrics"]


@pytest.mark.slow
def test_cached_classifier_round_in_a_fresh_process_imports_no_heavy_library(
    tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path
) -> None:
    overrides = " ".join(
        [*tiny_overrides(tiny_llama, synthetic_tsv), "fl.clients=2", "fl.local_epochs=1"]
    )
    # What the server sends: global head, fingerprint, global label map
    settings = load_settings(overrides)
    label_map = load_splits(settings.dataset, seed=settings.seed).label_map
    hidden = json.loads((tiny_llama / "config.json").read_text())["hidden_size"]
    initial = build_retriever(settings, len(label_map), hidden_size=hidden).trainable_state_dict()
    save_file(initial, str(tmp_path / "initial.safetensors"))
    args = {
        "initial": str(tmp_path / "initial.safetensors"),
        "fingerprint": fingerprint(settings),
        "labels": label_map.to_list(),
        "overrides": overrides,
        "node_config": {
            "partition-id": 1,
            "num-partitions": 2,
            "data-path": str(synthetic_tsv),
            "cache-dir": str(tmp_path / "node-cache"),
        },
    }

    cold_modules, cold = client_round(args, tmp_path / "cold.safetensors")
    warm_modules, warm = client_round(args, tmp_path / "warm.safetensors")

    # The cold round needed everything (so the check below can fail) ...
    assert {"transformers", "datasets", "hydra"} <= cold_modules
    assert cold["encoder-loads"] == 1
    # ... the cached one none of it: settings, shard and features came from the node's disk
    assert not set(HEAVY) & warm_modules, sorted(set(HEAVY) & warm_modules)
    assert warm["encoder-loads"] == 0
    assert warm["num-examples"] == cold["num-examples"] > 0
    # and it trained on the same data from the same start: the same reply, bit for bit
    cold_state = load_file(str(tmp_path / "cold.safetensors"))
    warm_state = load_file(str(tmp_path / "warm.safetensors"))
    assert cold_state.keys() == warm_state.keys() == initial.keys()
    for name in cold_state:
        assert torch.equal(cold_state[name], warm_state[name]), name
        assert not torch.equal(cold_state[name], initial[name]), f"{name} was not trained"


@pytest.mark.slow
def test_settings_are_composed_once_per_node_then_read_from_disk(
    tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = " ".join(tiny_overrides(tiny_llama, synthetic_tsv))
    node_config = {"cache-dir": str(tmp_path), "device": "cpu", "partition-id": 0}
    expected = apply_node_config(load_settings(overrides), node_config)
    server = fingerprint(load_settings(overrides))
    first = node_settings_module.node_settings({"overrides": overrides}, node_config, server)
    assert first == expected
    # a new process: nothing in memory, and no composition may happen

    def no_composition(run_config: object) -> None:
        raise AssertionError("composed again although the node has the settings on disk")

    monkeypatch.setattr(node_settings_module, "settings_from_run_config", no_composition)
    assert (
        node_settings_module.node_settings({"overrides": overrides}, node_config, server)
        == expected
    )
    # the fingerprint is checked on the cached path too: a server with another configuration
    other = fingerprint(load_settings(overrides + " seed=7"))
    with pytest.raises(ValueError, match="different configuration"):
        node_settings_module.node_settings({"overrides": overrides}, node_config, other)
    # other overrides are another entry, composed anew
    with pytest.raises(AssertionError, match="composed again"):
        node_settings_module.node_settings({"overrides": overrides + " seed=7"}, node_config, None)


@pytest.mark.parametrize(
    "overrides",
    [
        "",
        "mode=adapter dp=adaptive fl.clients=3 head.pre_classifier_dim=8 head.dropout=0.1",
        "dataset=ag_news model=minilm dp=fixed eval.top_k=[1,2] comm.dtype=float16",
    ],
)
def test_settings_survive_the_json_round_trip(overrides: str) -> None:
    settings = load_settings(overrides)
    stored = json.loads(json.dumps(asdict(settings)))
    assert node_cache.settings_from_dict(stored) == settings
    assert fingerprint(node_cache.settings_from_dict(stored)) == fingerprint(settings)
    # a value the dataclasses reject is rejected on the way back too
    stored["train"]["batch_size"] = 0
    with pytest.raises(ValueError, match=r"train\.batch_size"):
        node_cache.settings_from_dict(stored)
    stored["train"]["batch_size"] = 4
    stored["train"]["unknown_key"] = 1
    with pytest.raises(TypeError):
        node_cache.settings_from_dict(stored)


def test_settings_key_changes_with_any_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = shutil.copytree(conf_dir(), tmp_path / "conf")
    monkeypatch.setattr(node_cache, "conf_dir", lambda: conf)
    node = {"partition-id": 0, "data-path": "/data/a.tsv"}
    before = node_cache.settings_key("mode=adapter", node)
    assert node_cache.settings_key("mode=adapter", node) == before
    assert node_cache.settings_key("mode=classifier", node) != before
    assert node_cache.settings_key("mode=adapter", {**node, "data-path": "/b.tsv"}) != before
    with (conf / "mode" / "adapter.yaml").open("a") as handle:
        handle.write("\n# a changed default\n")
    assert node_cache.settings_key("mode=adapter", node) != before


@pytest.mark.parametrize("source", sorted(node_cache.settings_code()))
def test_settings_key_changes_with_the_schema_and_composition_code(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every module that composes settings or holds a default is in the key (a section's
    defaults, the heads' registrations): one changed, the node composes again."""
    code = node_cache.settings_code()
    for name in ("schema", "compose", "retriever", "inputs", "federation", "choices"):
        assert f"car_fl/settings/{name}.py" in code
    assert {
        "car_fl/adapters/config.py",
        "car_fl/heads/config.py",
        "car_fl/common/choice.py",
    } <= set(code)
    package = tmp_path / "car_fl"
    for name, path in code.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, tmp_path / name)
    monkeypatch.setattr(node_cache, "PACKAGE_DIR", package)
    source = source.removeprefix("car_fl/")
    node = {"partition-id": 0}
    before = node_cache.settings_key("", node)
    with (package / source).open("a") as handle:
        handle.write("\n# a changed default\n")
    assert node_cache.settings_key("", node) != before


def test_shard_cache_follows_the_data_file_and_survives_a_corrupt_entry(
    tmp_path: Path, make_settings, synthetic_tsv: Path
) -> None:
    data = Path(shutil.copy(synthetic_tsv, tmp_path / "data.tsv"))
    settings = make_settings(f"dataset.path={data}")
    common: dict[str, Any] = {"num_partitions": 2, "data_is_shard": False}
    key = node_cache.shard_key(settings, partition_id=0, **common)
    assert key is not None
    assert node_cache.shard_key(settings, partition_id=1, **common) != key
    node_cache.save_shard(settings, key, ["a", "b"], [0, 1], LabelMap(("x", "y")))
    texts, ids, _ = node_cache.load_shard(settings, key) or ([], [], None)
    assert (texts, ids) == (["a", "b"], [0, 1])
    # an edited data file is another shard
    with data.open("a") as handle:
        handle.write("ham\tone more line\n")
    assert node_cache.shard_key(settings, partition_id=0, **common) != key
    # a corrupt entry is ignored (read the data again), not fatal
    node_cache.shard_path(settings, key).write_text("{not json")
    assert node_cache.load_shard(settings, key) is None
    # a hub dataset (no local file) is not cached here
    settings.dataset.path = None
    assert node_cache.shard_key(settings, partition_id=0, **common) is None

"""car_fl.client.round: a node's shard, encoded with the server's label map."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from car_fl.client.round import shard_data
from car_fl.settings.compose import NodeInfo


def test_clients_encode_labels_with_the_servers_map(make_settings, tmp_path: Path) -> None:
    local = tmp_path / "local.tsv"
    local.write_text("topic0\tk0 w1\ntopic2\tk2 w2\n" * 3, encoding="utf-8")
    settings = make_settings(f"dataset.path={local}")
    server_labels = ["topic0", "topic1", "topic2", "topic3"]
    shard = shard_data(settings, NodeInfo(0, 2, data_is_shard=True), server_labels)
    assert shard.label_map.to_list() == server_labels
    assert shard.examples == len(shard.data) == 6  # a pre-made shard: every row, no split
    assert sorted(set(shard.data.labels.tolist())) == [0, 2]  # ids of the server's map


def test_labels_the_servers_map_lacks_are_left_out_and_counted_only_in_the_nodes_log(
    make_settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # This node's own file has a label the server never saw ('spam', twice).
    local = tmp_path / "local.tsv"
    local.write_text("topic0\tk0 w1\ntopic2\tk2 w2\nspam\tbuy now\n" * 2, encoding="utf-8")
    settings = make_settings(f"dataset.path={local}")
    with caplog.at_level(logging.WARNING, logger="car_fl.client.round"):
        shard = shard_data(settings, NodeInfo(0, 2, data_is_shard=True), ["topic0", "topic2"])
    assert len(shard.data) == 4 and shard.examples - len(shard.data) == 2
    assert shard.examples == 6  # n counts every example: it must not depend on the labels
    assert "spam: 2" in caplog.text  # the node's own log names them; no exception does


def test_a_long_lived_process_sees_an_edited_data_file_as_another_shard(
    make_settings, tmp_path: Path
) -> None:
    from car_fl.client.round import shard_data

    # The node's worker keeps shards in memory across runs; its owner edits the data between two
    local = tmp_path / "local.tsv"
    local.write_text("topic0\tk0 w1\ntopic2\tk2 w2\n" * 3, encoding="utf-8")
    settings = make_settings(f"dataset.path={local}", "mode=adapter")
    node = NodeInfo(0, 1, data_is_shard=True)
    memory: dict = {}  # a Node's shards
    first = shard_data(settings, node, memory=memory)
    assert shard_data(settings, node, memory=memory) is first  # kept in memory
    with local.open("a", encoding="utf-8") as handle:
        handle.write("topic1\tk1 w3\n")
    second = shard_data(settings, node, memory=memory)
    assert (len(first.data), len(second.data)) == (6, 7)
    assert second.label_map.to_list() == ["topic0", "topic1", "topic2"]

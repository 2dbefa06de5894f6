"""car_fl.client.shard: a node's shard, encoded with the server's label map."""

from __future__ import annotations

from pathlib import Path

import pytest

from car_fl.settings.flower import NodeInfo


def test_clients_encode_labels_with_the_servers_map(make_settings, tmp_path: Path) -> None:
    from car_fl.client.round import shard_data

    # This node's own file lacks 'topic3' and has a label the server never saw.
    local = tmp_path / "local.tsv"
    local.write_text("topic0\tk0 w1\ntopic2\tk2 w2\nspam\tbuy now\n" * 3, encoding="utf-8")
    settings = make_settings(f"dataset.path={local}")
    server_labels = ["topic0", "topic1", "topic2", "topic3"]
    with pytest.raises(ValueError, match=r"not in the global label map: \['spam'\]"):
        shard_data(settings, NodeInfo(0, 2), server_labels)
    local.write_text("topic0\tk0 w1\ntopic2\tk2 w2\n" * 3, encoding="utf-8")
    settings = make_settings(f"dataset.path={local}", "cache_dir=" + str(tmp_path / "c2"))
    data, label_map = shard_data(settings, NodeInfo(0, 2, data_is_shard=True), server_labels)
    assert label_map.to_list() == server_labels
    assert len(data) == 6  # a pre-made shard: every row, no split, no partitioning
    assert sorted(set(data.labels.tolist())) == [0, 2]  # ids of the server's map


def test_a_long_lived_process_sees_an_edited_data_file_as_another_shard(
    make_settings, tmp_path: Path
) -> None:
    from car_fl.client.shard import shard_data

    # The node's worker keeps shards in memory across runs; its owner edits the data between two
    local = tmp_path / "local.tsv"
    local.write_text("topic0\tk0 w1\ntopic2\tk2 w2\n" * 3, encoding="utf-8")
    settings = make_settings(f"dataset.path={local}", "mode=adapter")
    node = NodeInfo(0, 1, data_is_shard=True)
    first, _ = shard_data(settings, node)
    assert shard_data(settings, node)[0] is first  # kept in memory
    with local.open("a", encoding="utf-8") as handle:
        handle.write("topic1\tk1 w3\n")
    second, label_map = shard_data(settings, node)
    assert (len(first), len(second)) == (6, 7)
    assert label_map.to_list() == ["topic0", "topic1", "topic2"]

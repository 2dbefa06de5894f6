"""Tests of car_fl.model; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE: dict[str, str] = {
    "blockless": "tests/blocks/test_remote_blocks.py::test_node_holds_no_block",
    "loading": "tests/model/test_encoder.py::test_identity_adapter_gives_the_plain_models_hidden_states",
    "feature_cache": "tests/model/test_features.py::test_the_disk_cache_round_trips_per_text_and_leaves_no_temporary_file",
    "adapter": "tests/model/test_encoder.py::test_identity_adapter_gives_the_plain_models_hidden_states",
}

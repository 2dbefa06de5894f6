"""Tests of car_fl.server; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    "aggregation": "tests/server/test_strategy.py::test_every_strategy_name_builds_flowers_own_strategy",
    "round_stats": "tests/server/test_federation.py::test_an_anonymous_error_reply_is_attributed_to_the_silent_node",
    "shard_claims": "tests/server/test_replies.py::test_example_counts_are_capped_by_the_partition_the_server_pinned_to_each_node",
    "simulation_exit": "tests/commands/test_run_superlink.py::test_flowers_local_superlink_is_refused_while_it_installs_and_keeps_no_ray_of_a_stopped_run",
    "update_norm": "tests/server/test_strategy.py::test_update_norm_is_the_l2_norm_of_all_tensors_and_inf_when_not_finite",
}

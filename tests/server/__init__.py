"""Tests of car_fl.server; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    "aggregation": "tests/server/test_strategy.py::test_every_strategy_name_builds_flowers_own_strategy",
    "simulation_exit": "tests/commands/test_run_superlink.py::test_flowers_local_superlink_is_refused_while_it_installs_and_keeps_no_ray_of_a_stopped_run",
}

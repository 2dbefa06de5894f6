"""Tests of car_fl.deploy; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    "own_superlink": "tests/commands/test_run_superlink.py::test_a_stopped_run_leaves_no_process_behind",
    "cluster": "tests/deploy/test_processes.py::test_cluster_ports_environment_and_node_command",
}

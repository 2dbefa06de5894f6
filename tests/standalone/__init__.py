"""Tests of car_fl.standalone; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE: dict[str, str] = {
    "centralized": "tests/test_centralized.py::test_centralized_run_writes_config_metrics_plot_and_checkpoints",
}

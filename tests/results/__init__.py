"""Tests of car_fl.results; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    "report_markdown": "tests/results/test_report.py::test_the_report_has_one_row_per_run_with_speed_up_and_epsilon",
}

"""Tests of car_fl.settings; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    "dp_plan": "tests/privacy/test_dpsgd.py::test_plan_calibrates_for_rounds_times_epochs_times_steps_per_epoch",
}

"""Tests of car_fl.settings; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    # the sections of the schema: every check in them is exercised through Settings
    "choices": "tests/settings/test_schema.py::test_every_head_mode_and_lexical_index_is_one_approach",
    "inputs": "tests/settings/test_schema.py::test_dataset_without_path_or_hub_is_rejected",
    "retriever": "tests/settings/test_schema.py::test_bad_configuration_is_rejected_clearly",
    "federation": "tests/settings/test_schema.py::test_fl_timeouts_and_dirichlet_alpha_are_validated",
    "dp_plan": "tests/privacy/test_dpsgd.py::test_plan_calibrates_for_rounds_times_epochs_times_steps_per_epoch",
}

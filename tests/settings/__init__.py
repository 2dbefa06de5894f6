"""Tests of car_fl.settings; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    # the sections of the schema: every check in them is exercised through Settings
    "choices": "tests/settings/test_schema.py::test_every_head_mode_and_lexical_index_is_one_approach",
    "inputs": "tests/settings/test_schema.py::test_dataset_without_path_or_hub_is_rejected",
    "retriever": "tests/settings/test_schema.py::test_bad_configuration_is_rejected_clearly",
    "federation": "tests/settings/test_schema.py::test_fl_timeouts_and_dirichlet_alpha_are_validated",
    "spec": "tests/settings/test_dp_modes.py::test_what_a_round_releases_is_the_modes_figure",
    "none": "tests/settings/test_dp_modes.py::test_what_a_round_releases_is_the_modes_figure",
    "fixed": "tests/settings/test_dp_modes.py::test_what_a_round_releases_is_the_modes_figure",
    "adaptive": "tests/settings/test_dp_modes.py::test_adaptives_release_composes_the_update_and_the_indicator",
    "record": "tests/settings/test_dp_modes.py::test_a_modes_rules_refuse_when_the_settings_are_composed",
    "registry": "tests/settings/test_dp_modes.py::test_every_mode_has_one_spec_with_its_own_report_name",
    "dp_plan": "tests/privacy/test_dpsgd.py::test_plan_calibrates_for_rounds_times_epochs_times_steps_per_epoch",
}

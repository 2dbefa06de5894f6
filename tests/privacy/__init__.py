"""Tests of car_fl.privacy; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    "adaptive": "tests/privacy/test_mechanism.py::test_geometric_rule_moves_the_bound_by_the_noised_indicator",
    "accountant": "tests/privacy/test_mechanism.py::test_one_release_epsilon_matches_dp_accounting_and_grows",
    "record_accounting": "tests/privacy/test_dpsgd.py::test_epsilon_of_a_known_configuration_equals_dp_accounting",
}

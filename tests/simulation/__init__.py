"""Tests of car_fl.simulation; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    "apps": "tests/server/test_attacks.py::test_one_hostile_client_of_three_does_not_poison_the_model",
    "hostile": "tests/server/test_attacks.py::test_one_hostile_client_of_three_does_not_poison_the_model",
}

"""Tests of car_fl.heads; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE: dict[str, str] = {
    "scorer": "tests/heads/test_registry.py::test_every_head_kind_has_one_scorer_and_its_traits",
}

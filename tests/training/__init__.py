"""Tests of car_fl.training; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE: dict[str, str] = {}

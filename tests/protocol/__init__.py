"""Tests of car_fl.protocol; a module without its ``test_<module>.py`` says where it is tested."""

TESTED_ELSEWHERE: dict[str, str] = {}

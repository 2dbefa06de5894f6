"""Tests of car_fl.client; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE: dict[str, str] = {
    "local_dp_round": "tests/client/test_local_dp.py::test_per_step_dp_noises_every_accounted_step_so_the_update_size_does_not_tell_n",
}

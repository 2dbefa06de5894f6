"""Tests of car_fl.client; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE: dict[str, str] = {
    "answer": "tests/client/test_worker.py::test_a_second_round_with_a_worker_loads_no_encoder_and_the_clientapp_imports_no_torch",
}

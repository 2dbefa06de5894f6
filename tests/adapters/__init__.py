"""Tests of car_fl.adapters; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE: dict[str, str] = {
    "adapter": "tests/adapters/test_registry.py::test_every_kind_starts_as_the_identity",
    "lowrank": "tests/adapters/test_registry.py::test_a_lowrank_adapter_sends_2dr_numbers",
    "diagonal": "tests/adapters/test_registry.py::test_per_example_norms_and_clipped_sum_equal_autograd",
}

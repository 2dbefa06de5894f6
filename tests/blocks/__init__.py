"""Tests of car_fl.blocks; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE: dict[str, str] = {
    "wire": "tests/blocks/test_service_input.py::test_wrong_shapes_values_and_sizes_are_refused",
    "parts": "tests/blocks/test_remote_blocks.py::test_node_holds_no_block",
    "compute": "tests/blocks/test_remote_blocks.py::test_a_request_alone_equals_it_batched_with_others",
    "client": "tests/blocks/test_client_faults.py::test_a_refusal_is_never_retried",
    "errors": "tests/blocks/test_node_blocks.py::test_an_unavailable_service_is_its_own_failure_code",
    "dedupe": "tests/blocks/test_deadlines.py::test_a_retry_while_the_first_run_computes_waits_for_it_and_is_never_computed_again",
    "remote": "tests/blocks/test_remote_blocks.py::test_adapter_gradient_through_remote_blocks_equals_local",
}

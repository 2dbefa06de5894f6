"""Tests of car_fl.serving; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE: dict[str, str] = {
    "ray_app": "tests/serving/test_retrieval_service.py::test_sigterm_answers_the_requests_in_flight_then_stops_leaving_no_process",
    "retrieval_client": "tests/serving/test_langchain_retriever.py::test_it_needs_exactly_one_source_and_a_positive_k",
}

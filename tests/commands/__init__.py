"""Tests of car_fl.commands; a module without its ``test_<module>.py`` says where it is tested."""

TESTED_ELSEWHERE = {
    "serve_blocks": "tests/serving/test_blocks_service.py::test_over_http_states_and_gradients_equal_local_blocks",
    "serve": "tests/serving/test_retrieval_service.py::test_it_answers_what_load_retriever_retrieves_and_names_what_it_serves",
    "retrieve": "tests/test_cli.py::test_retrieve_command_prints_top_k_labels",
    "report": "tests/results/test_report.py::test_the_report_command_on_run_directories",
}

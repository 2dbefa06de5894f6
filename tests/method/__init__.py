"""Tests of car_fl.method; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    "feature_cache": "tests/method/test_features.py::test_the_disk_cache_round_trips_per_text_and_leaves_no_temporary_file",
    "adapter": "tests/method/test_encoder.py::test_identity_adapter_gives_the_plain_models_hidden_states",
    "centralized": "tests/test_centralized.py::test_centralized_run_writes_config_metrics_plot_and_checkpoints",
    "evaluation": "tests/results/test_selection.py::test_best_checkpoint_follows_validation_when_test_disagrees",
}

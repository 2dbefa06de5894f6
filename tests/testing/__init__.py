"""Tests of car_fl.testing; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    "tiny": "tests/training/test_train.py::test_training_reaches_high_accuracy",
}

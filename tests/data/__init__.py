"""Tests of car_fl.data; a module without its ``test_<module>.py`` says where it is tested."""

#: module → the test that covers it (checked by ``tests/test_layout.py``).
TESTED_ELSEWHERE = {
    "labels": "tests/data/test_readers.py::test_label_map_rejects_unknown_labels_by_name",
    "dedupe": "tests/data/test_splits.py::test_dedupe_collapses_copies_and_drops_conflicting_labels",
    "partition": "tests/data/test_splits.py::test_iid_shards_are_a_seeded_permutation_not_contiguous_slices",
    "placement": "tests/data/test_splits.py::test_one_record_added_moves_no_other_record_only_under_the_hash_placement",
}

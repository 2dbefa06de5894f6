"""Data (both parties): readers, the global label map, duplicates, splits and client shards.

- :mod:`~car_fl.data.readers`: one reader per file format (``Example``, ``DataFormatError``).
- :mod:`~car_fl.data.labels`: ``LabelMap``.
- :mod:`~car_fl.data.dedupe`: exact duplicates after normalisation, before any split.
- :mod:`~car_fl.data.splits`: ``load_splits``: train/validation/test (``DataSplits``).
- :mod:`~car_fl.data.partition`: ``partition``: a client's shard (flwr-datasets).
- :mod:`~car_fl.data.placement`: ``hash_placement``: a record's split and shard by its own text.
- :mod:`~car_fl.data.corpus`, :mod:`~car_fl.data.corpus_splits`: document corpora and their
  per-document splits with new documents.
- :mod:`~car_fl.data.pseudo_queries`: windows of a document's own words as training queries.

Imports nothing itself: ``car_fl.data.labels`` must not pull in ``datasets`` (2.5 s).
"""

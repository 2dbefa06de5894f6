"""Tiny offline models and data for tests, benchmarks and trying car-fl without the hub.

- :mod:`~car_fl.testing.tiny`: ``build_llama``, ``build_bert``, ``synthetic_examples``,
  ``write_tsv``, ``tiny_overrides`` (``python -m car_fl.testing.tiny DIR``).
"""

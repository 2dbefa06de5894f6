"""Results (both parties): what a run writes, and reports across runs.

- :mod:`~car_fl.results.rows`: ``RoundRow``, ``ClientRow``, ``RunSummary``, ``MetricsFile``
  (``metrics.json``, ``metrics.csv``, ``clients.csv``), ``wire_key``.
- :mod:`~car_fl.results.recorder`: ``Recorder``: log lines, checkpoints, files per round/epoch.
- :mod:`~car_fl.results.resume`: a stopped run read back to continue it, centralised or federated.
- :mod:`~car_fl.results.selection`: the best model, on validation, never on test.
- :mod:`~car_fl.results.checkpoint`: ``save_checkpoint`` / ``load_checkpoint``.
- :mod:`~car_fl.results.plots`, :mod:`~car_fl.results.report`,
  :mod:`~car_fl.results.report_markdown`: plots and ``car-fl report``.
"""

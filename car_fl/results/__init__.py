"""Results (both parties): what a run writes, and reports across runs.

- :mod:`~car_fl.results.rows`: ``RoundRow``, ``ClientRow``, ``RunSummary``, ``MetricsFile``.
- :mod:`~car_fl.results.run`: ``Run``: one run's folder, rows, selection (on validation, never
  on test), patience, checkpoints (``save_checkpoint`` / ``load_checkpoint``), resume, end.
- :mod:`~car_fl.results.plots`, :mod:`~car_fl.results.report`,
  :mod:`~car_fl.results.report_markdown`: plots and ``car-fl report``.
"""

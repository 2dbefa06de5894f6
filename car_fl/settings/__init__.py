"""Settings (both parties): one typed schema, composed from ``conf/`` once, and Flower's configs.

- :mod:`~car_fl.settings.schema`: ``Settings``, the checks that span sections, and every part's
  name (the one import a caller needs); the single source of defaults. Its sections, by what
  they configure: :mod:`~car_fl.settings.inputs` (dataset, model),
  :mod:`~car_fl.settings.retriever` (head, experts, training, evaluation),
  :mod:`~car_fl.settings.federation` (FL, strategy, wire, DP); the :class:`Choice` enums and
  the approaches in :mod:`~car_fl.settings.choices`.
- :mod:`~car_fl.settings.compose`: Hydra composition (``load_settings``, ``to_settings``,
  ``settings_to_yaml``).
- :mod:`~car_fl.settings.flat`: settings as dotted keys, and the keys two runs differ in.
- :mod:`~car_fl.settings.dp_plan`: what a run releases under each DP mode
  (``round_release``), the record-level plan (``record_plan``) and its check.
- :mod:`~car_fl.settings.flower`: Flower's run config and node config (``NODE_CONFIG``,
  ``NodeInfo``, ``fingerprint``, ``settings_from_run_config``).
"""

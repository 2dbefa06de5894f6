"""Settings (both parties): one typed schema, composed from ``conf/`` once, and Flower's configs.

- :mod:`~car_fl.settings.schema`: ``Settings`` and its sections, the :class:`Choice` enums,
  validation that needs nothing else; the single source of defaults.
- :mod:`~car_fl.settings.compose`: Hydra composition (``load_settings``, ``to_settings``,
  ``settings_to_yaml``).
- :mod:`~car_fl.settings.dp_plan`: the record-level DP plan a configuration implies
  (``record_plan``) and its check (a reachable target ε).
- :mod:`~car_fl.settings.flower`: Flower's run config and node config (``NODE_CONFIG``,
  ``NodeInfo``, ``fingerprint``, ``settings_from_run_config``).
"""

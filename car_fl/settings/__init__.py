"""Settings (both parties): one typed schema, composed from ``conf/`` once, and Flower's configs.

- :mod:`~car_fl.settings.schema`: ``Settings``, the checks that span sections, every part's name.
- :mod:`~car_fl.settings.inputs`: its dataset and model sections.
- :mod:`~car_fl.settings.retriever`: its adapter, training and evaluation sections (the head's
  and the experts' are :mod:`car_fl.heads.config`'s, with each head kind and its approaches).
- :mod:`~car_fl.settings.federation`: its FL, strategy, wire and DP sections.
- :mod:`~car_fl.settings.choices`: the :class:`Choice` enums no head owns.
- :mod:`~car_fl.settings.compose`: Hydra composition (``load_settings``, ``to_settings``), and
  Flower's run config and node config, and the fingerprint.
- :mod:`~car_fl.settings.flat`: settings as dotted keys, and the keys two runs differ in.
- :mod:`~car_fl.settings.dp_plan`: what a run releases under each DP mode, and its check.
"""

"""DP modes as a registry: each ``dp.mode`` is one module here and one line of ``MODES``, asked
instead of switching on the mode (docs/privacy.md, "Adding a DP mode").

- :mod:`~car_fl.settings.dp_modes.spec`: ``DPModeSpec``, what a mode is, and ``ClientLevel``.
- :mod:`~car_fl.settings.dp_modes.none`, :mod:`~car_fl.settings.dp_modes.fixed`,
  :mod:`~car_fl.settings.dp_modes.adaptive`, :mod:`~car_fl.settings.dp_modes.record`: the modes.
- :mod:`~car_fl.settings.dp_modes.registry`: ``MODES``, ``dp.mode`` → its spec.
"""

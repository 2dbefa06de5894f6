"""DP modes as a registry: each ``dp.mode`` is one module of this package and one line of
:data:`~car_fl.settings.dp_modes.registry.MODES`; composing the settings, the node, the
server's check, one machine and ``car-fl report`` ask it instead of switching on the mode
(docs/privacy.md, "Adding a DP mode"). A mode's mechanism stays in :mod:`car_fl.privacy` and
the node's round that makes its releases in :mod:`car_fl.client` (named by the mode,
imported on the node only).

- :mod:`~car_fl.settings.dp_modes.spec`: ``DPModeSpec`` (what a mode releases and its ε, its
  settings rules, what it asks of a node's policy, how one machine trains under it, its
  report name) and ``ClientLevel``, the base of the modes that noise a node's whole update.
- :mod:`~car_fl.settings.dp_modes.none`, :mod:`~car_fl.settings.dp_modes.fixed`,
  :mod:`~car_fl.settings.dp_modes.adaptive`, :mod:`~car_fl.settings.dp_modes.record`: the modes.
- :mod:`~car_fl.settings.dp_modes.registry`: ``MODES``, ``dp.mode`` → its spec.
"""

"""Small utilities every party uses.

- :mod:`~car_fl.common.choice`: ``Choice``, a setting's fixed values, and the shared checks.
- :mod:`~car_fl.common.io`: atomic writes (``atomic_write``, ...): every file car-fl writes.
- :mod:`~car_fl.common.hub`: ``offline_unless_reachable``: the Hub out of reach, in seconds.
- :mod:`~car_fl.common.progress`: progress bars that draw on a terminal only; ``setup_logging``
  for the apps and entry points.
- :mod:`~car_fl.common.stopping`: processes ended by PID (SIGTERM, a grace, SIGKILL).
"""

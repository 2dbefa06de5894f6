"""Privacy (the data owner's): DP mechanisms and accounting only, no orchestration, no Flower.

- :mod:`~car_fl.privacy.mechanism`: Gaussian noise from OS entropy on the tensors' device;
  norms, clipping (per release and per example, joint or adapter and head apart), the noised
  release (``privatize``).
- :mod:`~car_fl.privacy.accountant`: the one accountant (PLD, replace-one) every party uses.
- :mod:`~car_fl.privacy.dpsgd`: a DP-SGD step (Poisson sampling, per-example gradients, noise).
- :mod:`~car_fl.privacy.ghost`: DP-SGD's clipped sum through the adapter from batched passes.
- :mod:`~car_fl.privacy.record_accounting`: DP-SGD plans and σ calibration.

The stateful use of these on a node is :mod:`car_fl.client`.
"""

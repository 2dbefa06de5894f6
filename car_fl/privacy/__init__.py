"""Local differential privacy on each client: clipping, Gaussian noise, adaptive clipping, ε.

Pure functions live in :mod:`~car_fl.privacy.mechanism` (norms, clipping, noise, the
adaptive rule) and :mod:`~car_fl.privacy.accountant` (ε from Rényi DP); the stateful client
side in :mod:`~car_fl.privacy.client`.
"""

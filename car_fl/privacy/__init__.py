"""Local differential privacy on each client: clipping, Gaussian noise, adaptive clipping, ε.

Pure functions live in :mod:`~car_fl.privacy.mechanism` (norms, clipping, the noised
release), :mod:`~car_fl.privacy.adaptive` (the private geometric rule for the clipping bound,
and the paper's non-private linear rule), :mod:`~car_fl.privacy.noise` (noise from OS entropy
on the parameters' device) and :mod:`~car_fl.privacy.accountant` (ε from Rényi DP with
dp-accounting); the stateful client side in :mod:`~car_fl.privacy.client`.
"""

"""How a retriever learns and is measured, the same in every run (one machine or a node).

- :mod:`~car_fl.training.train`: epochs (DP-SGD included) and their torch.optim optimisers;
  ``HeldOut`` (validation selects, test is reported); top-K, MRR, nDCG, F1 from ranks;
  linear probing, the head alone before adapter + classifier; one torch thread for small
  steps (``threads_for``).
"""

"""The method (both parties): the CaR retriever, its training and its evaluation.

- :mod:`~car_fl.method.encoder`: the frozen encoder (``load_encoder``, ``Encoder``), device and
  dtype; :mod:`~car_fl.method.adapter`: the soft-embedding adapter.
- :mod:`~car_fl.method.head`, :mod:`~car_fl.method.scorers`, :mod:`~car_fl.method.retrieval`:
  the classifier head, one scorer per retrieval method (CaR, MIPS, kNN), their scores.
- :mod:`~car_fl.method.model`: ``CaRRetriever`` (encoder → adapter → pooling → scorer) and
  ``build_retriever``; :mod:`~car_fl.method.serving`: ``load_retriever`` from a checkpoint.
- :mod:`~car_fl.method.features`: length-bucketed extraction and the feature cache
  (``prepare_for``, ``LocalData``).
- :mod:`~car_fl.method.train`, :mod:`~car_fl.method.metrics`: epochs (DP-SGD included) and
  their torch.optim optimisers, top-K/MRR/F1; :mod:`~car_fl.method.evaluation`:
  ``HeldOut`` (validation and test).
"""

"""car-fl: federated, differentially private Classifier-as-Retriever (CaR) training with Flower.

The package is laid out by who runs the code (``docs/architecture.md``):

- :mod:`car_fl.heads`: the heads and scorers (classifier, documents, experts, MIPS/kNN, BM25).
- :mod:`car_fl.model`: the frozen encoder, the adapter, features and the assembled retriever.
- :mod:`car_fl.training`: epochs (DP-SGD included), the linear probe, held-out evaluation.
- :mod:`car_fl.serving`: a trained retriever loaded from its checkpoint; RAG; query generation.
- :mod:`car_fl.standalone`: a run on one machine without Flower, and its resume.
- :mod:`car_fl.data`: readers, label map, dedupe, splits, partitions (both parties).
- :mod:`car_fl.privacy`: DP mechanisms and accounting only (run by the data owner).
- :mod:`car_fl.client`: one round on a data owner's machine (a Flower SuperNode).
- :mod:`car_fl.server`: the aggregator (the ServerApp): strategies, guards, rounds, evaluation.
- :mod:`car_fl.protocol`: what crosses the wire between them.
- :mod:`car_fl.results`: typed result rows, the recorder, checkpoints, plots, reports.
- :mod:`car_fl.settings`: the configuration schema, its composition, Flower's configs.
- :mod:`car_fl.simulation`: both parties in one process (Flower's engine, in-process, attacks).
- :mod:`car_fl.deploy`: the operator's tools for SuperLink and SuperNodes on real machines.
- :mod:`car_fl.common`: small utilities; :mod:`car_fl.testing`: tiny offline models and data.
- Entry points: :mod:`car_fl.centralized`, :mod:`car_fl.sweep`, :mod:`car_fl.cli`.

A package's ``__init__`` imports nothing, so importing one module never loads its siblings.
"""

__version__ = "0.1.0"

"""The data owner's side: code that runs on a node (a Flower SuperNode), next to its data.

- :mod:`~car_fl.client.node`: ``Node``, the data owner's side in one object: every check a
  node makes before anything leaves it, and what it keeps between rounds.
- :mod:`~car_fl.client.round`: ``train_round``, one round: shard → features → epochs → DP →
  reply, the same skeleton for every privacy mode.
- :mod:`~car_fl.client.local_dp`: local DP (fixed or adaptive clipping) and its state.
- :mod:`~car_fl.client.record_dp`: record-level DP-SGD and its state.
- :mod:`~car_fl.client.shard`: this node's shard, features and local retriever.
- :mod:`~car_fl.client.node_settings`: the run's settings with this node's own paths.
- :mod:`~car_fl.client.node_cache`: what the node keeps on disk between rounds.
- :mod:`~car_fl.client.ledger_registry`: which ledger covers which records, for all of an
  owner's policies (one ledger per record).
"""

"""The data owner's side: code that runs on a node (a Flower SuperNode), next to its data.

- :mod:`~car_fl.client.node`: ``Node``, every check a node makes and what it keeps: the run's
  settings with this node's own paths, every run's state on a node, in one store.
- :mod:`~car_fl.client.round`: a round's skeleton, the same for every privacy mode; this node's
  shard, features and local retriever; what a node sends of a mixture of experts.
- :mod:`~car_fl.client.local_dp`: local DP (fixed or adaptive clipping), its state and its ε;
  a round's epochs and release under it.
- :mod:`~car_fl.client.record_dp`: record-level DP-SGD and its state.
- :mod:`~car_fl.client.node_cache`: what the node keeps on disk between rounds.
- :mod:`~car_fl.client.node_privacy`: the owner's policy and lifetime ledger in a round.
- :mod:`~car_fl.client.policy`: the owner's privacy policy file, validated.
- :mod:`~car_fl.client.node_reading`: how a node with a policy reads its data.
- :mod:`~car_fl.client.ledger`: every release ever made, accounted per record.
- :mod:`~car_fl.client.ledger_registry`: which ledger covers which records (one per record).
- :mod:`~car_fl.client.failures`: refusals and errors turned into data-free replies.
- :mod:`~car_fl.client.worker`: the node's worker process.
- :mod:`~car_fl.client.worker_link`: the ClientApp's side of the worker's local socket.
- :mod:`~car_fl.client.confinement`: a SuperNode under its own account reaches the worker only.
"""

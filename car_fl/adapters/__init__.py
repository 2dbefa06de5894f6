"""The soft-embedding adapter ADP, ``TRF(ADP(TKN(x)))``, in the forms of ``adapter.kind``.

Each kind is one :class:`~car_fl.adapters.adapter.Adapter` subclass in its own module, registered
once in :mod:`car_fl.adapters.registry`; each is the identity at start, names its tensors (what
travels and what a checkpoint holds), measures its distance from the identity (the anchor) and
gives DP-SGD each example's gradient norm and the clipped sum from one batched backward
(docs/privacy.md, "Record-level differential privacy (DP-SGD)").

- :mod:`car_fl.adapters.adapter`: the interface (``Adapter``).
- :mod:`car_fl.adapters.full`: the d×d matrix; :mod:`car_fl.adapters.lowrank`: I + U Vᵀ;
  :mod:`car_fl.adapters.diagonal`: x ⊙ s + b.
- :mod:`car_fl.adapters.registry`: ``adapter.kind`` → its class (``build_adapter``).
"""

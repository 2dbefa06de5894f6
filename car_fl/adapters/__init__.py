"""The soft-embedding adapter ADP, ``TRF(ADP(TKN(x)))``, in the forms of ``adapter.kind``.

Each kind is the identity at start and gives DP-SGD each example's gradient norm and the
clipped sum from one batched backward (docs/architecture.md, "Adding an adapter kind").

- :mod:`car_fl.adapters.config`: each ``adapter.kind``'s one registration and the ``adapter``
  settings section; no torch.
- :mod:`car_fl.adapters.adapter`: the interface (``Adapter``), the method's d×d matrix, an
  adapter built from its kind's class (``build_adapter``).
- :mod:`car_fl.adapters.lowrank`: I + U Vᵀ; :mod:`car_fl.adapters.diagonal`: x ⊙ s + b.
"""

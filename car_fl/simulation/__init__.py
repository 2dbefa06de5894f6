"""Both parties in one process: simulations of a federation.

- :mod:`~car_fl.simulation.flower`: ``run_simulation``: one complete Flower simulation (Ray).
- :mod:`~car_fl.simulation.in_process`: ``run_local``: a federation without Ray.
- :mod:`~car_fl.simulation.hostile`: hostile clients (``hostile_client``, ``poison``).
- :mod:`~car_fl.simulation.label_mix`: a curious server's attack on a shard's label mix.
- :mod:`~car_fl.simulation.centralized_dp`: record-level DP-SGD as a one-node federation.
- :mod:`~car_fl.simulation.apps`: the project's ``server_app`` / ``client_app`` modules.
"""

"""The aggregator's side: code that runs in the ServerApp.

- :mod:`~car_fl.server.federation`: ``run_federation``: nodes, initial model, rounds, results;
  the run's ``evaluate_fn`` (now or in a thread) and ``ServerEvaluator`` (held-out splits).
- :mod:`~car_fl.server.strategy`: ``GuardedStrategy``: any Flower strategy behind car-fl's checks
  (valid replies, partitions pinned per node, the update-norm bound, what a round saw).
- :mod:`~car_fl.server.aggregation`: the strategy registry.
- :mod:`~car_fl.server.privacy_check`: each client's ε as the server computes it, and its claim.
- :mod:`~car_fl.server.expert_plan`: which experts each client is sent and may send back.
- :mod:`~car_fl.server.failure_summary`: why a run got no valid update, counted per code.
- :mod:`~car_fl.server.simulation_exit`: a stopped simulation ends the Ray processes it started.
"""

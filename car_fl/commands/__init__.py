"""The ``car-fl`` command's subcommands, one module each (wired by :mod:`car_fl.cli`).

Each module has ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.

- :mod:`~car_fl.commands.train`: centralised training on this machine.
- :mod:`~car_fl.commands.run`: ``flwr run`` this project, follow it, exit with its outcome.
- :mod:`~car_fl.commands.retrieve`: top-K labels for queries, from a checkpoint.
- :mod:`~car_fl.commands.report`: tables and plots from sweep or run directories.
- :mod:`~car_fl.commands.ledger`: a node owner reads the privacy ledger of its data.
- :mod:`~car_fl.commands.worker`: this node's worker, which holds the encoder across rounds.
- :mod:`~car_fl.commands.ask`: retrieve a question's documents and let a causal LM answer.
- :mod:`~car_fl.commands.generate_queries`: training queries for a corpus, written by its SLM.
- :mod:`~car_fl.commands.serve`: a checkpoint's retriever as an endpoint (Ray Serve).
- :mod:`~car_fl.commands.serve_blocks`: a model's frozen blocks served to many nodes.
"""

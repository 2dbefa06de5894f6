"""Deployment on several machines with Flower's own engine: SuperLink + SuperNodes over gRPC.

Nothing in the apps imports it; the scripts in ``scripts/`` are thin fronts to it.

- :mod:`~car_fl.deploy.commands`: Flower's executables' command lines, a node's ``--node-config``.
- :mod:`~car_fl.deploy.certs`: a private CA, a server certificate, SuperNode key pairs.
- :mod:`~car_fl.deploy.connection`: the ``flwr`` connection in ``config.toml``, node keys.
- :mod:`~car_fl.deploy.processes`: processes started, and stopped, by PID.
- :mod:`~car_fl.deploy.ports`: a free port, a held one, one that accepts connections.
- :mod:`~car_fl.deploy.runs`: ``flwr run`` / ``flwr ls`` and their JSON output.
- :mod:`~car_fl.deploy.cluster`: a whole local cluster, the one way scripts and tests build it.
- :mod:`~car_fl.deploy.local_superlink`: Flower's local SuperLink, found and checked.
- :mod:`~car_fl.deploy.own_superlink`: one ``car-fl run``'s own SuperLink, ended with it.
"""

"""Deployment on several machines with Flower's own engine: SuperLink + SuperNodes over gRPC.

Apart from the method: nothing in the apps imports it. One module per concern:

- :mod:`~car_fl.deploy.commands`: ``flower-superlink`` / ``flower-superexec`` /
  ``flower-supernode`` command lines and a SuperNode's ``--node-config`` string;
- :mod:`~car_fl.deploy.certs`: a private CA, a server certificate, SuperNode key pairs;
- :mod:`~car_fl.deploy.connection`: the ``flwr`` connection in ``config.toml``, node keys
  registered with ``flwr supernode register``;
- :mod:`~car_fl.deploy.processes`: processes started, and stopped, by PID;
- :mod:`~car_fl.deploy.ports`: a free port, a held one, one that accepts connections;
- :mod:`~car_fl.deploy.runs`: ``flwr run`` / ``flwr ls`` and their JSON output;
- :mod:`~car_fl.deploy.cluster`: a whole local cluster, the one way scripts and tests build it;
- :mod:`~car_fl.deploy.local_superlink`: Flower's local SuperLink, found by its port, checked
  by its PID, its environment and its folder;
- :mod:`~car_fl.deploy.own_superlink`: a simulation SuperLink of one ``car-fl run``'s own,
  ended with every process it started.

The scripts in ``scripts/`` are thin command-line fronts to this package.
"""

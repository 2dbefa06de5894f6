"""Deployment on several machines with Flower's own engine: SuperLink + SuperNodes over gRPC.

Apart from the method: nothing in the apps imports it. One module per concern:

- :mod:`~car_fl.deploy.commands`: ``flower-superlink`` / ``flower-superexec`` /
  ``flower-supernode`` command lines and a SuperNode's ``--node-config`` string;
- :mod:`~car_fl.deploy.certs`: a private CA, a server certificate, SuperNode key pairs;
- :mod:`~car_fl.deploy.connection`: the ``flwr`` connection in ``config.toml``, node keys
  registered with ``flwr supernode register``;
- :mod:`~car_fl.deploy.processes`: processes started, and stopped, by PID;
- :mod:`~car_fl.deploy.runs`: ``flwr run`` / ``flwr ls`` and their JSON output;
- :mod:`~car_fl.deploy.cluster`: a whole local cluster, the one way scripts and tests build it.

The scripts in ``scripts/`` are thin command-line fronts to this package.
"""

from car_fl.deploy.certs import TLSFiles, make_certificates, make_node_key
from car_fl.deploy.cluster import LocalCluster, RunResult, free_port
from car_fl.deploy.commands import (
    CONTROL_PORT,
    FLEET_PORT,
    node_config_string,
    pinned,
    superexec_command,
    superlink_command,
    supernode_command,
)
from car_fl.deploy.connection import register_node, write_connection
from car_fl.deploy.processes import Processes
from car_fl.deploy.runs import COMPLETED, run_status, start_run, wait_for_run

__all__ = [
    "COMPLETED",
    "CONTROL_PORT",
    "FLEET_PORT",
    "LocalCluster",
    "Processes",
    "RunResult",
    "TLSFiles",
    "free_port",
    "make_certificates",
    "make_node_key",
    "node_config_string",
    "pinned",
    "register_node",
    "run_status",
    "start_run",
    "superexec_command",
    "superlink_command",
    "supernode_command",
    "wait_for_run",
    "write_connection",
]

"""car_fl.deploy.ports: a free port, a held one, one that accepts connections."""

from __future__ import annotations

import socket

from car_fl.deploy.ports import LOOPBACK, free_port, listening, port_in_use


def test_a_held_port_is_in_use_and_accepts_connections_only_while_listening() -> None:
    port = free_port()
    assert not port_in_use(LOOPBACK, port)
    assert not listening(f"{LOOPBACK}:{port}")
    with socket.socket() as held:
        held.bind((LOOPBACK, port))
        assert port_in_use(LOOPBACK, port)
        assert not listening(f"{LOOPBACK}:{port}")  # bound, not listening
        held.listen()
        assert listening(f"{LOOPBACK}:{port}")
    assert not port_in_use(LOOPBACK, port)

"""The test worlds' helpers (dist_world.py)."""

import socket

from dist_world import FIRST_PORT, _ephemeral_range, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    """Outgoing connections (gloo's, of another world) take ephemeral ports: a store's port drawn below
    that range cannot be taken by one between the draw and the store's bind; nor can a Ray head's
    port collide with Ray's worker ports (10002-19999)."""
    low, _ = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and all(FIRST_PORT <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))

"""The test worlds' helpers (dist_world.py)."""

import socket

from dist_world import _ephemeral_range, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    """Outgoing connections (gloo's, of another world) take ephemeral ports: a store's port drawn below
    that range cannot be taken by one between the draw and the store's bind."""
    low, _ = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and all(10_000 <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))

"""`characters serve`'s port pre-check: refuses a port a server listens on, accepts one that a stopped server
left with connections in TIME_WAIT (the pre-check once refused to start for a minute after every stop)."""

from __future__ import annotations

import socket

from deployments.cli.serve import _port_in_use


def _time_wait_port() -> int:
    """A port whose server closed an accepted connection first (that side lingers in TIME_WAIT), then stopped."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = int(server.getsockname()[1])
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end of the connection enters TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    return port


def test_a_port_left_in_time_wait_is_free_for_the_next_server():
    port = _time_wait_port()
    plain = socket.socket()  # what the old pre-check did: bind without SO_REUSEADDR
    try:
        plain.bind(("127.0.0.1", port))
        lingering = False
    except OSError:
        lingering = True
    finally:
        plain.close()
    assert lingering, "the connection did not linger in TIME_WAIT; the test would not see the old refusal"
    assert not _port_in_use("127.0.0.1", port)


def test_a_port_with_a_listener_is_in_use():
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = int(listener.getsockname()[1])
        assert _port_in_use("127.0.0.1", port)
        assert _port_in_use("0.0.0.0", port)

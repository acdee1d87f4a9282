"""Ports `up` and the test meshes hand to services: free, and outside the range
the kernel gives outgoing connections' local ends (a port from there can be taken
by any connection before the service binds it; CI failed so once)."""

import socket

from tools.launch.up import ephemeral_ports, free_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range() -> None:
    low, _ = ephemeral_ports()
    for _ in range(20):
        port = free_port()
        assert 0 < port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out() -> None:
    held = []
    try:
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        assert len({s.getsockname()[1] for s in held}) == 50
    finally:
        for s in held:
            s.close()

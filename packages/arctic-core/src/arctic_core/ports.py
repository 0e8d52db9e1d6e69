"""A free TCP port on this machine's loopback, for the rendezvous of processes that Arctic starts
itself (a DeepSpeed world of one, the Ray trainer's ranks, tests' servers).

The port is free when asked for and is not held: a process that binds it later may lose it to
another in between, which the short gap between asking and binding makes rare."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

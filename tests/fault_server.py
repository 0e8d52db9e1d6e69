"""An ``arctic-rl serve``-like HTTP server process that kills itself (SIGKILL) at a chosen point:
in the middle of its second ``save_checkpoint`` (tests/test_faults.py), or mid-run of a framework
(the adapters' tests of a server that goes away); or never (the adapters' tests that read its
``/metrics`` after a framework's run).

usage: python fault_server.py CONFIG_JSON KILL_POINT   (prints the server's URL on one line)

Kill points:
- ``trainer-files``: the trainer has written one file of its checkpoint into the staging folder;
- ``between-renames``: the previous checkpoint has been moved aside, the new one not yet moved in;
- ``generate-after-step``: a ``generate`` arrives after an optimizer ``step`` (the second training
  step's sampling), before it is answered;
- ``never``: it serves until it is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch
import uvicorn

from arctic_core.config import ArcticConfig
from arctic_core.serving.http import create_app
from arctic_core.serving.server import ArcticServer


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(server: ArcticServer, point: str) -> None:
    """Make the second save_checkpoint of ``server`` die at ``point``."""
    saves = 0
    save_op = server._op_save_checkpoint

    def counting_save(request):
        nonlocal saves
        saves += 1
        return save_op(request)

    server._op_save_checkpoint = counting_save
    if point == "trainer-files":
        torch_save = torch.save

        def save_then_die(obj, f, *args, **kwargs):
            torch_save(obj, f, *args, **kwargs)
            if saves == 2:
                die()

        torch.save = save_then_die
    elif point == "between-renames":
        os_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if saves == 2 and ".tmp-" in os.fspath(src):  # the old copy was moved aside just before
                die()
            return os_replace(src, dst, *args, **kwargs)

        os.replace = replace
    elif point == "generate-after-step":
        arm_generate_after_step(server)
    elif point != "never":
        raise SystemExit(f"unknown kill point {point!r}")


def arm_generate_after_step(server: ArcticServer) -> None:
    step_op, generate_op = server._op_step, server._op_generate
    stepped = False

    def step(request):
        nonlocal stepped
        result = step_op(request)
        stepped = True
        return result

    def generate(request, cancel=None):
        if stepped:
            die()
        return generate_op(request, cancel)

    server._op_step, server._op_generate = step, generate


def main() -> None:
    config_json, point = sys.argv[1:]
    server = ArcticServer(ArcticConfig.model_validate_json(config_json))
    arm(server, point)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # connections wait in the backlog until uvicorn accepts them
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning")).run(sockets=[sock])


def start_for(policy: Path, point: str) -> tuple[subprocess.Popen[str], str]:
    """This script in a process of its own, serving ``policy`` on the torch backend until ``point``
    (the adapters' tests of a server that goes away); returns the process and its URL."""
    config = {"model": {"path": str(policy), "device": "cpu"}, "trainer": {"backend": "torch"}}
    proc = subprocess.Popen([sys.executable, __file__, json.dumps(config), point],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:  # libraries print banners first; the URL comes once it listens
        if line.startswith("http://127.0.0.1:"):
            return proc, line.strip()
    raise AssertionError(f"the server did not start (exit status {proc.wait()})")


if __name__ == "__main__":
    main()

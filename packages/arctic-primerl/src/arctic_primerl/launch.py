"""``arctic-primerl rl @ rl.toml``: Arctic in this process, PRIME-RL's processes beside it.

What PRIME-RL's ``rl`` launcher starts, less the two sides Arctic serves: one ``env-server`` per
environment source (at the address its orchestrator derives: ``env_server_base_port`` + index, train
sources first) and the ``orchestrator``, each with its config written as JSON under
``{run}/configs`` when it starts and its log under ``{run}/logs``. The trainer loop runs here; a
process that fails ends the run with its log's last lines.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arctic_core.adapters.preflight import check_backend, check_positions, check_server
from arctic_core.cli import is_loopback
from arctic_core.errors import ArcticError
from arctic_primerl.config import RunSettings, source_name

EXIT_WAIT_S = 120.0


@dataclass
class Process:
    name: str
    command: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    config_file: Path | None = None
    config: dict[str, Any] | None = None
    """Written to ``config_file`` when the process starts (a dry run writes nothing)."""

    def start(self, env: dict[str, str]) -> None:
        if self.config_file is not None:
            _write(self.config_file, self.config)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as out:
            self.popen = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def returncode(self) -> int | None:
        """The exit status (None while it runs)."""
        return self.popen.poll() if self.popen else None

    def failure(self) -> str | None:
        """Why the process ended badly (None while it runs or after a clean exit)."""
        code = self.returncode()
        if code in (None, 0):
            return None
        tail = self.log.read_text(errors="replace").strip().splitlines()[-15:]
        return f"{self.name} exited with status {code} (log: {self.log}):\n" + "\n".join(tail)

    def stop(self) -> None:
        if self.popen and self.popen.poll() is None:
            self.popen.terminate()  # env servers wait out a SIGINT; SIGTERM ends them
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()


def env_sources(orchestrator: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """``(split, source, address)`` of every environment source, as PRIME-RL orders and places them."""
    sources = [("train", s) for s in orchestrator.get("train", {}).get("source", [])]
    sources += [("eval", s) for s in (orchestrator.get("eval") or {}).get("source", [])]
    base = orchestrator.get("env_server_base_port", 5000)
    return [(split, source, source.get("serve", {}).get("address") or f"tcp://127.0.0.1:{base + i}")
            for i, (split, source) in enumerate(sources)]


def prime_rl_processes(run: RunSettings) -> list[Process]:
    """The env servers PRIME-RL's launcher would start, then the orchestrator; each writes its
    config when it starts."""
    configs, logs = run.run_dir / "configs", run.run_dir / "logs"
    orchestrator = run.orchestrator_config()
    processes = []
    for split, source, address in env_sources(orchestrator):
        if source.get("serve", {}).get("address"):
            continue  # an externally managed server: only the orchestrator connects to it
        name = source_name(source)
        config = {"env": source.get("env", {}), "serve": {**source.get("serve", {}), "address": address}}
        path = configs / "envs" / split / f"{name}.json"
        processes.append(Process(f"env server {split}/{name}", [*run.arctic.env_server_command, "@", str(path)],
                                 logs / "envs" / split / f"{name}.log", config_file=path, config=config))
    path = configs / "orchestrator.json"
    processes.append(Process("orchestrator", [*run.arctic.orchestrator_command, "@", str(path)],
                             logs / "orchestrator.log", config_file=path, config=orchestrator))
    return processes


def _write(path: Path, config: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2, default=str))
    return path


def check_commands(run: RunSettings) -> None:
    for what, command in (("orchestrator", run.arctic.orchestrator_command),
                          ("env-server", run.arctic.env_server_command)):
        if shutil.which(command[0]) is None:
            raise ArcticError(f"PRIME-RL's {what} command {command[0]!r} {not_found(command[0])}: run arctic-primerl "
                              f"in PRIME-RL's environment (install arctic-primerl there), or set [arctic] "
                              f"{what.replace('-', '_')}_command")


def not_found(program: str) -> str:
    """Why ``shutil.which`` finds no ``program``: a name with a folder in it is a path, started as it
    is (a relative one from the working folder), never looked up on PATH."""
    if os.sep not in program and not (os.altsep and os.altsep in program):
        return "is not on PATH"
    path = Path(program)
    where = "" if path.is_absolute() else f" ({path.resolve()})"
    return f"is not executable{where}" if path.is_file() else f"does not exist{where}"


def check_port(host: str, port: int) -> None:
    """The front's port is free (found now, not after the backend has loaded the model)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the front binds: a closed run's port is free
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ArcticError(f"cannot serve PRIME-RL's inference routes on {host}:{port} ({exc.strerror}): set "
                              "inference.server.port (and nothing else may use it)") from None


class Watchdog(threading.Thread):
    """Stops the trainer when one of PRIME-RL's processes fails, keeping the reason: a process that
    exits with an error, or the orchestrator (the last process) ending cleanly while the trainer
    waits for a rollout file (``awaited``) that no one is left to write."""

    def __init__(self, processes: list[Process], stop: threading.Event,
                 awaited: Callable[[], Path | None] = lambda: None) -> None:
        super().__init__(daemon=True, name="primerl-watchdog")
        self.processes, self.stop, self.awaited, self.reason = processes, stop, awaited, None

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.reason = next(filter(None, (p.failure() for p in self.processes)), None) or self._orchestrator_gone()
            if self.reason:
                self.stop.set()
                return

    def _orchestrator_gone(self) -> str | None:
        orchestrator = self.processes[-1]
        if orchestrator.returncode() != 0:  # running (or failed: reported above)
            return None
        path = self.awaited()  # read after the exit: the orchestrator writes nothing more
        if path is None or path.exists():
            return None
        return (f"{orchestrator.name} exited (status 0) before writing {path}, which the trainer waits for "
                f"(log: {orchestrator.log})")


def preflight(run: RunSettings) -> tuple[str | None, list[Process]]:
    """The front's token and PRIME-RL's processes (not started; nothing written), once every check
    passes; the first problem raises an ArcticError naming it, before any model is loaded."""
    token = api_token(run.orchestrator)
    if not token and not is_loopback(run.arctic.host):
        raise ArcticError(f"[arctic] host = {run.arctic.host!r} exposes the inference front: set the orchestrator's "
                          "API key variable (VLLM_API_KEY) so that it needs a token")
    check_commands(run)
    check_port(run.arctic.host, run.port)
    if run.arctic.starts_backend:
        check_backend(run.arctic_config(on_gpu=False))
    else:
        check_server(run.arctic, run.model_name, "model.name", None)
    check_positions(run.model_name, run.arctic.max_model_len or run.seq_len,
                    "the context served ([arctic] max_model_len, else seq_len)")
    return token, prime_rl_processes(run)


def api_token(orchestrator: dict[str, Any]) -> str | None:
    """The token PRIME-RL's clients send (``Authorization: Bearer $VLLM_API_KEY`` unless it is EMPTY)."""
    var = orchestrator.get("model", {}).get("client", {}).get("api_key_var", "VLLM_API_KEY")
    token = os.environ.get(var)
    return None if token in (None, "", "EMPTY") else token

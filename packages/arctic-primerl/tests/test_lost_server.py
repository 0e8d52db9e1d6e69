"""A server on ``[arctic] url`` that goes away mid-run: ``arctic-primerl rl`` stops PRIME-RL's
processes and ends on Arctic's line naming the server, not on the orchestrator's log or a trainer's
traceback.

The whole command runs with ``fake_orchestrator.py`` (PRIME-RL's orchestrator on the wire) and
``tests/fault_server.py``, an ``arctic-rl serve`` that kills itself (SIGKILL) when a sampling request
reaches it after the first optimizer step; which side fails first (the orchestrator's sampling or the
trainer's next call) depends on timing, so each is also run on its own, against a URL nobody serves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from arctic_core.client import ArcticClient
from arctic_core.ports import free_port
from arctic_primerl import cli, service
from arctic_primerl.config import read_run
from arctic_primerl.launch import Process
from adapter_suites import check_run_ends_on_lost_server
from runs import write_toml

FAKE_ORCHESTRATOR = Path(__file__).with_name("fake_orchestrator.py")


def remote_toml(tmp_path: Path, policy: Path, url: str) -> Path:
    """A 4-step run on the server at ``url``, its orchestrator the fake one, the front on a free port
    (PRIME-RL's processes read it from their config)."""
    arctic = (f'url = "{url}"\norchestrator_command = ["{sys.executable}", "{FAKE_ORCHESTRATOR}"]\n'
              f'env_server_command = ["{sys.executable}"]')
    toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", steps=4, arctic=arctic)
    text = toml.read_text().split("[arctic.config]")[0]  # a server named by url keeps its own config
    toml.write_text(text.replace("port = 0", f"port = {free_port()}"))
    return toml


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_server_gone_mid_run_is_named_on_the_last_line(policy, tmp_path):
    def run(url: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "arctic_primerl.cli", "rl", "@",
                               str(remote_toml(tmp_path, policy, url))],
                              cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=540)

    check_run_ends_on_lost_server(policy, "arctic-primerl", run,  # it dies after an optimizer step: mid-run
                                  rerun="restart it and rerun with a [resume] table in the config to continue from "
                                        "the last checkpoint")


class GoneService:
    """``ArcticPrimeRL`` as the command drives it, on a server that has gone: training fails as the
    client does, or (``waits``) waits for the watchdog to stop it."""

    def __init__(self, run, waits: bool) -> None:
        self.url, self.waits = run.arctic.url, waits
        self.trainer = SimpleNamespace(settings=SimpleNamespace(stop=threading.Event()), awaited=None)

    def start_front(self, token=None) -> str:
        return "http://127.0.0.1:0"

    def train(self) -> None:
        if self.waits:
            self.trainer.settings.stop.wait(60)
        else:
            ArcticClient.http(self.url).sync_weights()

    def stop(self) -> None:
        self.trainer.settings.stop.set()


@pytest.mark.parametrize("failing", ["trainer", "orchestrator"])
def test_either_side_failing_on_a_gone_server_ends_on_arctics_line(failing, policy, tmp_path, monkeypatch, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nobody serves it: the server has gone
    run = read_run(remote_toml(tmp_path, policy, url))
    monkeypatch.setattr(service, "ArcticPrimeRL", lambda run, on_gpu: GoneService(run, waits=failing == "orchestrator"))
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the command's SIGTERM handler, not pytest's
    processes = [Process("orchestrator", [sys.executable, "-c", "print('sampling failed'); raise SystemExit(1)"],
                         tmp_path / "orchestrator.log")] if failing == "orchestrator" else []
    with pytest.raises(SystemExit) as stopped:
        cli._run(run, processes, None, dict(os.environ))
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"arctic-primerl: error: the Arctic server at {url} went away (ConnectError: [Errno 111] "
                       "Connection refused); restart it and rerun with a [resume] table in the config to continue "
                       "from the last checkpoint")
    above = "\n".join(err[:-1])  # the failure as the run met it, above
    assert ("sync_weights to the Arctic server" if failing == "trainer"
            else "orchestrator exited with status 1") in above

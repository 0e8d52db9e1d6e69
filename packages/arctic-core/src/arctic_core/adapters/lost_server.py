"""The end of a framework's run whose Arctic server (``arctic.url``) went away.

A server that stops answering mid-run fails the next call the framework makes through Arctic,
often in one of its workers, and the framework then fails on its own terms (an empty batch, a dead
worker): the last line of the run names a consequence, the cause is far above it. When the run
fails, each adapter asks the server once more; if no connection can be made, the run ends on one
line that says so and how to go on.
"""

from __future__ import annotations

import contextlib
import sys
import traceback

import httpx

from arctic_core.adapters.preflight import exit_with
from arctic_core.adapters.settings import BackendSettings
from arctic_core.client import ArcticClient
from arctic_core.errors import RemoteError

PROBE_TIMEOUT_S = 5.0
# Only a connection that cannot be made means the server is gone: one that is made and answers late
# is a server busy with a call of the failed run.
GONE = (httpx.ConnectError, httpx.ConnectTimeout)


def lost_server(settings: BackendSettings) -> str | None:
    """Why the server at ``settings.url`` cannot be reached now, e.g. ``ConnectError: All connection
    attempts failed``; None while it answers (an error answer included) or when no URL is set."""
    if not settings.url:
        return None
    client = ArcticClient.http(settings.url, token=settings.token, timeout=PROBE_TIMEOUT_S)
    try:
        client.status()
    except RemoteError as exc:
        cause = exc.__cause__
        if exc.status is None and isinstance(cause, GONE):
            return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    finally:
        client.close()
    return None


def end_if_server_lost(adapter: str, settings: BackendSettings, rerun: str, failure: str | None = None) -> None:
    """Call where the run has failed: if its server cannot be reached, print the failure as the
    framework reports it (``failure``, else the exception being handled), then one line naming the
    server, and exit with status 2. Returns when the server answers: the failure is the run's own."""
    reason = lost_server(settings)
    if reason is None:
        return
    _stop_ray()
    _close_progress_bars()
    sys.stdout.flush()  # written to a file or pipe, what is buffered would land after the last line
    if failure is not None:
        print(failure, file=sys.stderr)
    elif sys.exc_info()[1] is not None:
        traceback.print_exc()
    exit_with(adapter, f"the Arctic server at {settings.url} went away ({reason}); restart it and {rerun}")


def _stop_ray() -> None:
    """Shut down the Ray this process started, if any: its workers' output reaches this process's
    stdout and stderr in the background, and nothing may print after the last line."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _close_progress_bars() -> None:
    """Close the framework's tqdm bars: one the failure left open redraws itself as the process
    exits, after the last line."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        with contextlib.suppress(Exception):
            bar.close()

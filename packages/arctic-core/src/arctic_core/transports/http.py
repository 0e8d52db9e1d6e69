"""The HTTP transport: protocol messages to an ``arctic-rl serve`` server, in the wire format.

``call`` blocks (``httpx.Client``); ``acall`` is truly async (``httpx.AsyncClient``: no thread
per call), so one event loop can keep hundreds of calls in flight. Errors the server reports come
back as the same :mod:`arctic_core.errors` classes with the server's message, so client code
handles a bad loss name the same way in process and over HTTP. Refusals with no Arctic class
(auth, size limit, a server bug, an unreachable server) raise :class:`RemoteError`.

A server that holds all the generate calls it takes answers 429 with ``Retry-After``: the call
waits that long and is sent again, until its ``timeout`` (then :class:`ServerBusy`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import httpx

from arctic_core import wire
from arctic_core.errors import ConfigError, RemoteError, remote_error
from arctic_core.protocol import Message, Result

TOKEN_ENV = "ARCTIC_RL_TOKEN"
MAX_IN_FLIGHT = 256  # async calls sent at once per client (the server batches generate calls together)
# An idle connection is dropped before a server would close it (uvicorn: after 5 s): a call sent on
# one the server is closing at that moment fails with no answer (a ReadError).
KEEPALIVE_EXPIRY_S = 2.0
_OFFLOAD_BYTES = 1 << 20  # results this big are decoded in a thread to keep the event loop free


class HttpTransport:
    """Talks to ``base_url`` (e.g. ``http://127.0.0.1:8000``); ``token`` defaults to ``$ARCTIC_RL_TOKEN``.

    ``timeout`` bounds each call in seconds once sent, including the time it waits on the server
    behind calls that cannot run beside it, and the retries of a call the server was too busy to
    take; None waits as long as a call takes. The server belongs to whoever started it, so
    closing a client does not shut it down (``owns_server`` is False).
    """

    owns_server = False

    def __init__(self, base_url: str, token: str | None = None, timeout: float | None = 600.0) -> None:
        self.base_url = checked_url(base_url)
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds or None (no limit), got {timeout!r}")
        source = TOKEN_ENV if token is None else "the token argument"
        token = os.environ.get(TOKEN_ENV) if token is None else token
        self._headers = {"Content-Type": wire.CONTENT_TYPE, "Accept": wire.CONTENT_TYPE}
        if token:  # an empty one means none
            check_token(token, source)
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = httpx.Timeout(timeout, connect=10.0 if timeout is None else min(timeout, 10.0))
        self._client: httpx.Client | None = None
        self._aclient: httpx.AsyncClient | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)

    # ----------------------------------------------------------------- calls
    def call(self, op: str, request: Message) -> Result:
        body = wire.encode_request(op, request)
        if self._client is None:
            self._client = httpx.Client(base_url=self.base_url, timeout=self._timeout,
                                        limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))
        deadline = self._deadline()
        while True:
            try:
                response = self._client.post(f"/v1/{op}", content=body, headers=self._headers)
            except httpx.HTTPError as exc:
                raise _unreachable(self.base_url, op, exc) from exc
            wait = _busy_wait(response, deadline)
            if wait is None:
                return _result(op, response)
            time.sleep(wait)

    async def acall(self, op: str, request: Message) -> Result:
        body = await _maybe_offload(wire.encode_request, op, request, big=getattr(request, "batch", None) is not None)
        client, slots = self._async_client()
        deadline = self._deadline()
        while True:
            async with slots:
                try:
                    response = await client.post(f"/v1/{op}", content=body, headers=self._headers)
                except httpx.HTTPError as exc:
                    raise _unreachable(self.base_url, op, exc) from exc
            wait = _busy_wait(response, deadline)
            if wait is None:
                return await _maybe_offload(_result, op, response, big=len(response.content) >= _OFFLOAD_BYTES)
            await asyncio.sleep(wait)

    def _deadline(self) -> float | None:
        """When a call stops retrying a busy server (its timeout from now)."""
        return None if self._timeout.read is None else time.monotonic() + self._timeout.read

    def _async_client(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        """The loop's client and the semaphore that bounds its calls in flight.

        An AsyncClient's connections belong to the event loop that opened them: a new loop (a
        second ``asyncio.run``) gets a new client. Calls beyond the bound wait on the semaphore,
        not in httpx's pool, whose bookkeeping grows with its queue (on loopback, hundreds of queued
        calls each took several times longer in the pool than behind the semaphore).
        """
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aloop is not loop:
            limits = httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=MAX_IN_FLIGHT,
                                  keepalive_expiry=KEEPALIVE_EXPIRY_S)
            self._aclient = httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout, limits=limits)
            self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
            self._aloop = loop
        return self._aclient, self._slots

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the blocking client; the async one is closed by :meth:`aclose` (it needs its loop)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    async def aclose(self) -> None:
        self.close()
        if self._aclient is not None and self._aloop is asyncio.get_running_loop():
            await self._aclient.aclose()
        self._aclient = self._aloop = None


# ----------------------------------------------------------------- helpers
def wait_until_serving(base_url: str, timeout: float = 120.0, alive: Callable[[], bool] = lambda: True) -> None:
    """Wait until the server at ``base_url`` answers ``GET /health`` (a script that starts
    ``arctic-rl serve`` and then connects); ``alive`` says whether the server process still runs.
    Raises :class:`RemoteError` after ``timeout`` seconds, or at once when ``alive()`` turns False
    (e.g. ``alive=lambda: process.poll() is None`` for a ``subprocess.Popen``)."""
    base_url = checked_url(base_url)
    deadline = time.monotonic() + timeout
    while alive():
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RemoteError(None, "Timeout",
                              f"the Arctic server at {base_url} did not answer /health within {timeout:g} s")
        time.sleep(0.2)
    raise RemoteError(None, "ServerExited",
                      f"the Arctic server process for {base_url} ended before it answered /health")


def checked_url(base_url: str) -> str:
    """``base_url`` without its trailing slash; a ConfigError unless it is an http(s) URL with a host
    (``localhost:8000`` would otherwise fail every call, or be retried until a timeout)."""
    try:
        url = httpx.URL(base_url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ConfigError(f"the server URL {base_url!r} is not a URL: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"the server URL {base_url!r} must start with http:// or https:// and name a host, "
                          "e.g. http://127.0.0.1:8000")
    return base_url.rstrip("/")


def check_token(token: str, source: str) -> None:
    """Refuse a bearer token that an HTTP header cannot carry as is, naming where it came from
    (``source``): clients send header values as ASCII (httpx refuses anything else), servers read
    them back as Latin-1 and strip the spaces around them, so such a token could never match."""
    if not (token.isascii() and token.isprintable() and token == token.strip()):
        raise ConfigError(f"the bearer token ({source}) must be printable ASCII with no space at either end: "
                          "an HTTP header carries it as is")


def _busy_wait(response: httpx.Response, deadline: float | None) -> float | None:
    """Seconds to wait before sending a call again that the server was too busy to take (429), or
    None: the answer stands (any other answer, or the retries would pass ``deadline``)."""
    if response.status_code != 429:
        return None
    try:
        wait = max(0.05, float(response.headers.get("Retry-After", "1")))
    except ValueError:
        wait = 1.0
    if deadline is not None and time.monotonic() + wait > deadline:
        return None
    return wait


def _result(op: str, response: httpx.Response) -> Result:
    if response.status_code == 200:
        return wire.decode_result(op, response.content)
    raise _error(response)


def _error(response: httpx.Response) -> Exception:
    """The server's error as the Arctic class it names, else as a :class:`RemoteError`."""
    try:
        data = response.json()
        name, message = str(data["error"]), str(data["message"])
    except (ValueError, KeyError, TypeError):
        return RemoteError(response.status_code, "HTTPError", response.text[:2000] or response.reason_phrase)
    return remote_error(response.status_code, name, message)


def _unreachable(base_url: str, op: str, exc: httpx.HTTPError) -> RemoteError:
    message = f"{op} to the Arctic server at {base_url} failed: {exc}"
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        # The request went out: the server runs it to its end (a fwd_bwd still adds its gradient).
        message += (" (the call may still run on the server: check status() before repeating it; a longer "
                    "timeout= for ArcticClient.http waits longer)")
    return RemoteError(None, type(exc).__name__, message)


async def _maybe_offload[T](fn: Callable[..., T], *args: Any, big: bool) -> T:
    """Run ``fn`` in a thread when its payload is big, inline otherwise (a thread hop per call
    would cost more than encoding a few prompts)."""
    return await asyncio.to_thread(fn, *args) if big else fn(*args)

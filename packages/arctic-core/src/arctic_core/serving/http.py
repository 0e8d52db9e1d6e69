"""The HTTP server: a FastAPI app that exposes an :class:`ArcticServer` over the wire format.

Endpoints (see ``/openapi.json`` of a running server, or ``/docs``):

- ``POST /v1/{op}`` for every operation in :data:`arctic_core.protocol.OPS`: the body is the
  request in the wire format (``arctic_core.wire``: safetensors bytes, never pickle), the answer
  is the result in the same format.
- ``GET /health``: status, policy version, step, engines and the calls running, as JSON. It never
  waits for a call.
- ``GET /metrics``: Prometheus text (calls, seconds, tokens per operation, process memory, and
  the sampler's load: requests running and waiting, preemptions, KV cache use, also under vLLM's
  gauge names).

**Calls run side by side**, each in a worker thread, so the event loop keeps answering
``/health`` and accepting requests while the engines compute: generate calls of every client
together (the embedded sampler runs them in shared steps) and beside training calls; training
calls one at a time (a ``fwd_bwd`` of one client never runs in the middle of another's
``step``); sleep, wake, checkpoints and shutdown alone, after the calls in flight. Gradients from
``fwd_bwd`` of all clients add up until a ``step``. A client that disconnects while its generate
call runs cancels it (its samples leave the batch). Generate calls in flight are bounded
(``server.max_generate_calls``); one more is answered 429 with ``Retry-After``.

Errors are JSON ``{"error": <class name>, "message": <what is wrong>}``:

| status | when |
|---|---|
| 400 | an Arctic error: malformed or truncated body, wrong dtype or shape, missing field (``RequestError``, ``BatchError``), an unknown loss or processor name (``PluginNotFoundError``: a bad value inside a valid request, not a missing URL, hence 400, not 404), a wrong state (engine asleep, server shut down) |
| 401 | a token is configured and the ``Authorization: Bearer`` header is missing or wrong (``/health`` and ``/openapi.json`` stay open: they reveal no data) |
| 404 | an unknown operation (``RequestError``) or path (``NotFound``) |
| 405 | a method other than POST on an operation (``MethodNotAllowed``) |
| 413 | a body over the size limit (checked on ``Content-Length`` before reading, and on the bytes read) |
| 429 | the server holds ``server.max_generate_calls`` generate calls (``ServerBusy``); retry after ``Retry-After`` seconds |
| 500 | an unexpected exception, with its message; the server keeps serving |
"""  # noqa: E501 (Markdown table rows: the docstring is the OpenAPI description)

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from arctic_core import wire
from arctic_core.errors import ServerBusy, error_answer
from arctic_core.serving.metrics import CallMetrics
from arctic_core.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from arctic_core.protocol import OPS, Message, Result
from arctic_core.serving.call_gate import KINDS
from arctic_core.serving.cancellation import Cancellation
from arctic_core.serving.server import ArcticServer
from arctic_core.transports.http import check_token

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 256 * 2**20
_RUNS_WITH = {"generate": "runs beside other generate and training calls", "train": "one training call at a time",
              "alone": "runs alone, after the calls in flight", "free": "never waits"}


class ApiError(Exception):
    """An HTTP-level refusal (auth, size, route) answered as ``{"error", "message"}`` JSON."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(message)
        self.status, self.error, self.message = status, error, message


def error_response(status: int, error: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse({"error": error, "message": message}, status_code=status, headers=headers)


def create_app(server: ArcticServer, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """The FastAPI app serving ``server``; ``token`` set means every call needs that bearer token.

    The ``arctic-rl serve`` command reads the token from ``--token`` or ``ARCTIC_RL_TOKEN``; here
    ``None`` means no authentication. ``on_shutdown`` runs once a ``shutdown`` call has succeeded
    and its answer has been sent (``arctic-rl serve`` stops uvicorn there).
    """
    if token is not None and not token:
        raise ValueError("the bearer token must not be empty (pass None for no authentication)")
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    app = FastAPI(title="Arctic RL", version="1", description=(__doc__ or "").replace("``", "`"))  # Markdown, not RST
    app.state.server, app.state.metrics = server, CallMetrics()
    authorised = Depends(bearer_check(token))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.error, exc.message)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own refusals (no route, wrong method) in the same format as every other error.
        error = HTTPStatus(exc.status_code).phrase.replace(" ", "")  # "MethodNotAllowed", as "PayloadTooLarge"
        return error_response(exc.status_code, error, _route_problem(request, exc), exc.headers)

    for op in OPS:
        after = on_shutdown if op == "shutdown" else None
        app.add_api_route(
            f"/v1/{op}", _op_endpoint(op, server, app.state.metrics, max_body_bytes, after), methods=["POST"],
            dependencies=[authorised], openapi_extra=_openapi_op(op),
            summary=f"{op} ({_RUNS_WITH[KINDS[op]]})",
            response_class=Response,
            responses={200: {"content": {wire.CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
        )

    @app.post("/v1/{op}", dependencies=[authorised], include_in_schema=False)
    async def _unknown_op(op: str) -> Response:
        return error_response(404, "RequestError", f"unknown operation {op!r}; operations: {sorted(OPS)}")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness and state; answers at once, even while calls run."""
        return _health(server)

    @app.get("/metrics", dependencies=[authorised], response_class=Response)
    async def metrics() -> Response:
        """Prometheus text format."""
        return Response(app.state.metrics.render(server.load()), media_type=METRICS_CONTENT_TYPE)

    return app


def _engine_health(engine: Any, backend: str, asleep: bool) -> dict[str, Any]:
    """Backend name, asleep or not, and whatever the engine reports itself (e.g. dead workers)."""
    own = engine.health() if callable(getattr(engine, "health", None)) else {}
    return {"backend": backend, "asleep": asleep, **own}


# ----------------------------------------------------------------- one operation
def _op_endpoint(
    op: str, server: ArcticServer, metrics: CallMetrics, limit: int, after: Callable[[], None] | None = None,
) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint of ``op``; ``after`` runs once a successful call's answer has been sent."""
    request_schema, _ = OPS[op]

    async def endpoint(request: Request) -> Response:
        try:
            body = await read_body(request, limit)
            message: Message = await asyncio.to_thread(wire.decode, body, request_schema)
            result: Result = await _unless_disconnected(request, server, op, message)
            payload = await asyncio.to_thread(wire.encode, result)
        except ApiError as exc:
            metrics.record_error(op, exc.error)
            return error_response(exc.status, exc.error, exc.message)
        except ClientDisconnect:  # the body never arrived whole, or the call was cancelled: nobody waits for an answer
            metrics.record_error(op, "ClientDisconnect")
            return error_response(400, "ClientDisconnect", "the client disconnected before the call's answer")
        except Exception as exc:  # bad input, or a bug / engine failure: answer it, keep serving
            status, error, message = error_answer(op, exc)
            if status == 500:
                log.exception("operation %r failed", op)
            metrics.record_error(op, error)
            retry = {"Retry-After": f"{ServerBusy.retry_after:g}"} if isinstance(exc, ServerBusy) else None
            return error_response(status, error, message, retry)
        metrics.record_ok(op, result, server.policy_version)
        return Response(payload, media_type=wire.CONTENT_TYPE, background=BackgroundTask(after) if after else None)

    endpoint.__name__ = f"op_{op}"
    endpoint.__doc__ = f"Request: `{request_schema.__name__}`; result: `{OPS[op][1].__name__}` (wire format)."
    return endpoint


async def _unless_disconnected(request: Request, server: ArcticServer, op: str, message: Message) -> Result:
    """The call's result; a client that disconnects first cancels the call (a generate call's
    samples leave the sampler's batch) and gets no answer."""
    cancel = Cancellation()
    call = asyncio.ensure_future(server.ahandle(op, message, cancel))
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((call, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not call.done():
        cancel.cancel()
        call.add_done_callback(lambda done: done.cancelled() or done.exception())  # its end is no one's to read
        raise ClientDisconnect()
    return call.result()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (ASGI's next message, once the body is read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "RequestError", f"Content-Length {declared!r} is not a byte count")
        if int(declared) > limit:
            raise ApiError(413, "PayloadTooLarge",
                           f"body of {declared} bytes exceeds the server's limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():  # chunked uploads declare no length: count as we read
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "PayloadTooLarge", f"body exceeds the server's limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# ----------------------------------------------------------------- auth, health, docs
def bearer_check(token: str | None, source: str = "ARCTIC_RL_TOKEN") -> Callable[..., None]:
    """A FastAPI dependency refusing calls without ``token`` (none: open); ``source`` names where
    the caller's token comes from, for the error message."""
    if token:
        check_token(token, source)  # one no client could send would lock every caller out
    scheme = HTTPBearer(auto_error=False, description=f"Required when the server has a token ({source}).")
    expected = token.encode() if token else None

    # A default, not Annotated[...]: string annotations cannot see the local ``scheme``.
    def check(credentials: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:  # noqa: B008
        if expected is None:
            return
        if credentials is None:
            raise ApiError(401, "Unauthorized",
                           f"missing bearer token: send 'Authorization: Bearer <token>' (the server's {source})")
        # Constant time: a wrong token must not reveal how many of its leading bytes were right.
        if not hmac.compare_digest(credentials.credentials.encode(), expected):
            raise ApiError(401, "Unauthorized", "wrong bearer token")

    return check


def _route_problem(request: Request, exc: HTTPException) -> str:
    """What is wrong with a request that reached no endpoint, and what the server does answer."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "other methods")
        return f"{where}: this path takes {allowed}; every operation is a POST"
    if exc.status_code == 404:
        return (f"{where}: no such endpoint; the server answers POST /v1/<operation> ({', '.join(sorted(OPS))}) "
                "and GET /health, /metrics, /openapi.json, /docs")
    return f"{where}: {exc.detail}"


def _health(server: ArcticServer) -> dict[str, Any]:
    config = server.config
    backends = {"trainer": config.trainer.backend, "sampler": config.sampler.backend}
    if server.reference is not None and config.reference is not None:
        backends["reference"] = config.reference.backend
    engines = {name: _engine_health(getattr(server, name), backend, server.closed or name in server.asleep)
               for name, backend in backends.items()}  # after shutdown every engine is asleep for good
    degraded = any(e.get("dead_ranks") for e in engines.values())
    load = server.load()
    return {
        "status": "shut down" if server.closed else "degraded" if degraded else "ok",
        "policy_version": server.policy_version,
        "step": server.step_count,
        "busy": any(v for k, v in load["calls"].items() if k != "waiting"),
        "calls": load["calls"],  # generate and training calls running, a lifecycle call running alone, waiting
        "engines": engines,
    }


def _openapi_op(op: str) -> dict[str, Any]:
    request_schema, result_schema = OPS[op]
    return {
        "requestBody": {
            "required": True,
            "description": (
                f"A `{request_schema.__name__}` in the wire format: safetensors bytes whose tensors are "
                f"the batch (`batch.<field>`) and whose metadata key `arctic` holds the other fields as JSON."
            ),
            "content": {wire.CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        },
        "description": (f"Runs `{op}` ({_RUNS_WITH[KINDS[op]]}); answers a `{result_schema.__name__}` in the wire "
                        "format."),
    }

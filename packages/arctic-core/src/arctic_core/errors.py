"""Arctic's exceptions: each names the problem so the caller can fix its input."""

from __future__ import annotations


class ArcticError(Exception):
    """Base class of every error Arctic raises on purpose."""


class ConfigError(ArcticError, ValueError):
    """A config failed validation; the message lists each bad field and why."""


class BatchError(ArcticError, ValueError):
    """A batch has a wrong shape, dtype, length or missing field."""


class PluginNotFoundError(ArcticError, LookupError):
    """No plugin provides the requested name; the message lists the registered ones."""


class PluginConflictError(ArcticError):
    """Two plugins provide the same name for the same kind (or two packages claim one plugin name)."""


class PluginError(ArcticError):
    """An installed plugin cannot be used (it fails to import, names an unknown hook, or a hook
    fails or answers wrongly); the message names the plugin."""


class RequestError(ArcticError, ValueError):
    """A client request is invalid (bad parameters, unknown op, wrong state)."""


def engine_asleep(engine: str) -> RequestError:
    """The refusal of a call to an engine put to sleep, naming it as the client's ``sleep`` and
    ``wake`` do ("trainer", "sampler", "reference"): every engine says it in the same words."""
    return RequestError(f"the {engine} is asleep; call wake([{engine!r}]) first")


class RemoteError(ArcticError, RuntimeError):
    """The server refused or failed a call for a reason with no Arctic error class."""

    def __init__(self, status: int | None, error: str, message: str) -> None:
        where = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{error} ({where}): {message}")
        self.status, self.error, self.message = status, error, message


class RequestCancelled(RequestError):
    """The call was cancelled (its caller went away) before it finished."""


class ServerBusy(ArcticError):
    """The server holds as many generate calls as it takes (``server.max_generate_calls``): retry
    after ``retry_after`` seconds (the clients do, until their timeout)."""

    retry_after = 1.0


class WorkerError(RequestError):
    """A worker process (e.g. one data-parallel training rank) died or failed; the message names it."""


def error_answer(op: str, exc: Exception) -> tuple[int, str, str]:
    """How a server answers a failed call, ``(status, error class name, message)``: an Arctic error
    is the caller's to fix (400, its own message), anything else a server failure (500).
    :func:`remote_error` turns the answer back into an exception on the client."""
    if isinstance(exc, ServerBusy):
        return 429, type(exc).__name__, str(exc)
    if isinstance(exc, ArcticError):
        return 400, type(exc).__name__, str(exc)
    return 500, type(exc).__name__, f"{op} failed on the server: {exc}"


def remote_error(status: int | None, name: str, message: str) -> ArcticError:
    """A server-side error as the Arctic class it names (for a refusal, status < 500), else as a
    :class:`RemoteError`: client code handles errors alike in process and over any transport."""
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, ArcticError) and cls is not RemoteError and (status or 500) < 500:
        return cls(message)
    return RemoteError(status, name, message)

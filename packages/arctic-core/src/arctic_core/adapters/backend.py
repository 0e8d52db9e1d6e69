"""Opening the backend an adapter's settings name: a running server, or one the adapter starts.

A framework may reach the backend from several processes (verl's trainer and its agent-loop
workers are Ray actors of their own), so a backend is also known by its :class:`BackendAddress`:
small, picklable, and able to open a client wherever it is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from arctic_core.adapters.settings import BackendSettings
from arctic_core.client import ArcticClient, AsyncArcticClient
from arctic_core.config import ArcticConfig

# Starts a backend for a config: its client, and its address when other processes can reach it.
Start = Callable[[ArcticConfig], tuple[ArcticClient, "BackendAddress | None"]]


@dataclass(frozen=True)
class BackendAddress:
    """A server Ray actor's name, or an HTTP URL with its token."""

    actor: str | None = None
    url: str | None = None
    token: str | None = None
    timeout: float = 600.0

    @classmethod
    def of(cls, settings: BackendSettings) -> BackendAddress:
        """The server the settings name (``url``, or an adapter's ``actor`` setting)."""
        return cls(actor=getattr(settings, "actor", None), url=settings.url, token=settings.token,
                   timeout=settings.timeout)

    def client(self) -> ArcticClient:
        if self.url:
            return ArcticClient.http(self.url, token=self.token, timeout=self.timeout)
        return ArcticClient.ray(name=self.actor)

    def async_client(self) -> AsyncArcticClient:
        if self.url:
            return AsyncArcticClient.http(self.url, token=self.token, timeout=self.timeout)
        return AsyncArcticClient.ray(name=self.actor)


def in_this_process(config: ArcticConfig) -> tuple[ArcticClient, None]:
    """A backend in the adapter's own process (no other process can reach it)."""
    return ArcticClient.in_process(config), None


def open_backend(settings: BackendSettings, config: Callable[[], ArcticConfig],
                 start: Start = in_this_process) -> tuple[ArcticClient, BackendAddress | None]:
    """A client of the server the settings name (it must answer now), or of a backend started
    with ``start`` for ``config()``, and the backend's address where other processes can reach it."""
    if settings.starts_backend:
        return start(config())
    address = BackendAddress.of(settings)
    client = address.client()
    client.status()  # reachable, and the token is right
    return client, address


def async_connect(client: ArcticClient, settings: BackendSettings) -> Callable[[], AsyncArcticClient]:
    """Opens async clients (a framework's inference client) of the backend ``client`` reaches: the
    server the settings name, or the backend :func:`open_backend` started in this process."""
    if not settings.starts_backend:
        return BackendAddress.of(settings).async_client
    return lambda: AsyncArcticClient(client.transport)  # the same in-process server

"""Transports move protocol messages between a client and a server.

A transport has ``call(op, request) -> result``, ``async acall(op, request) -> result`` and
``close()``. In-process is the embedded default; HTTP and Ray plug in behind the same seam.
"""

from __future__ import annotations

from typing import Protocol

from arctic_core.protocol import Message, Result


class Transport(Protocol):
    def call(self, op: str, request: Message) -> Result: ...
    async def acall(self, op: str, request: Message) -> Result: ...
    def close(self) -> None: ...

"""The in-process transport: the server lives in the client's process; calls are direct."""

from __future__ import annotations

from arctic_core.protocol import Message, Result
from arctic_core.serving.server import ArcticServer


class InProcessTransport:
    def __init__(self, server: ArcticServer) -> None:
        self.server = server

    def call(self, op: str, request: Message) -> Result:
        return self.server.handle(op, request)

    async def acall(self, op: str, request: Message) -> Result:
        # The server's threads keep the event loop free while the engines compute (as many as it
        # takes generate calls, which wait for their samples there).
        return await self.server.ahandle(op, request)

    def close(self) -> None:
        """Nothing to release: the server's lifetime is the caller's (see ``shutdown``)."""

"""An asyncio event loop in a thread of its own, for vLLM's ``AsyncLLM``.

The server calls its sampler from many threads; ``AsyncLLM`` lives on one event loop (its output
handler, its ZMQ sockets). This loop is that one: every call into vLLM is a coroutine sent here.
Plain asyncio on purpose: a cancelled request's task gets one ``CancelledError``, so vLLM's own
``generate`` can still await the abort that frees the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def start(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Runs ``coro`` on the loop; cancelling the future cancels its task."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.start(coro).result(timeout)

    @property
    def closed(self) -> bool:
        return self.loop.is_closed()

    def close(self) -> None:
        """Cancels the tasks left, lets them end, and stops the loop."""
        if self.loop.is_running():
            self.run(_cancel_all())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()


async def _cancel_all() -> None:
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

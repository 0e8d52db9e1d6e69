"""A call's cancellation: set when its caller goes away (an HTTP client disconnects, an awaiting
task is cancelled), so that what the call started (a generate request in the sampler's batch)
stops and gives its memory back instead of running for no one."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Cancellation:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the call is cancelled (at once if it already is)."""
        with self._lock:
            if not self.cancelled:
                self._callbacks.append(callback)
                return
        callback()

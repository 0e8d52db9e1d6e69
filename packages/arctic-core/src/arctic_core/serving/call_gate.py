"""Which calls run at the same time.

- ``generate`` calls run beside each other (the sampler batches them together) and beside training;
- training calls (``fwd_bwd``, ``step``, ``log_probs``, ``sync_weights``) run one at a time, so one
  client's ``fwd_bwd`` never lands inside another's ``step``;
- lifecycle calls (``sleep``, ``wake``, checkpoints, ``shutdown``) run alone: they wait for the
  calls in flight to end, and calls that come meanwhile wait for them;
- ``status`` never waits.

With ``colocate`` (the engines take turns on one device, each put to sleep while the other
computes) generation and training alternate instead: each waits for the other's calls in flight,
and a waiting side goes next rather than the running side taking new calls, so neither starves.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Literal

Kind = Literal["generate", "train", "alone", "free"]
KINDS: dict[str, Kind] = {
    "generate": "generate", "fwd_bwd": "train", "step": "train", "log_probs": "train", "sync_weights": "train",
    "save_checkpoint": "alone", "load_checkpoint": "alone", "sleep": "alone", "wake": "alone", "shutdown": "alone",
    "status": "free",
}


class CallGate:
    def __init__(self, colocate: bool) -> None:
        self.colocate = colocate
        self._changed = threading.Condition()
        self.running: Counter[Kind] = Counter()
        self.waiting: Counter[Kind] = Counter()
        self.alone: str | None = None  # the lifecycle call running, if any

    @contextlib.contextmanager
    def enter(self, op: str) -> Iterator[None]:
        kind = KINDS[op]
        if kind == "free":
            yield
            return
        with self._changed:
            self.waiting[kind] += 1
            try:
                self._changed.wait_for(lambda: self._may_enter(kind))
            finally:
                self.waiting[kind] -= 1
            self.running[kind] += 1
            self.alone = op if kind == "alone" else self.alone
        try:
            yield
        finally:
            with self._changed:
                self.running[kind] -= 1
                self.alone = None if kind == "alone" else self.alone
                self._changed.notify_all()

    def _may_enter(self, kind: Kind) -> bool:
        if self.running["alone"]:
            return False
        if kind == "alone":
            return not (self.running["generate"] or self.running["train"])
        if self.waiting["alone"]:  # a checkpoint is not starved by a stream of calls
            return False
        other = "train" if kind == "generate" else "generate"
        if self.colocate and (self.running[other] or (self.waiting[other] and self.running[kind])):
            return False
        return kind == "generate" or not self.running["train"]

    def state(self) -> dict[str, object]:
        """What runs and waits now (``/health``)."""
        return {"generate": self.running["generate"], "training": self.running["train"], "alone": self.alone,
                "waiting": {k: n for k, n in self.waiting.items() if n}}

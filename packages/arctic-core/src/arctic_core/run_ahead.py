"""Asynchronous RL with bounded staleness: rollouts run ahead of training by at most ``ahead`` steps.

A loop of your own, made asynchronous without changing its two halves:

    def rollout(step):            # sample: generate, rewards (the slow, not-GPU part included)
        ...
    def train(step, rollout):     # log-probs, fwd_bwd(..., max_staleness=ahead), step, sync_weights
        ...
    for metrics in run_ahead(steps, rollout, train, ahead=1):
        ...

``rollout(i)`` starts (in a thread of a small pool) once ``train(i - ahead - 1)`` has returned, so
while step ``i`` trains, the rollouts of steps ``i + 1 .. i + ahead`` are already sampling. With one
weight sync per ``train``, a rollout starts on policy ``i - ahead`` at the oldest and is trained at
``i``: no token is more than ``ahead`` syncs old (``fwd_bwd(max_staleness=ahead)`` then drops nothing
and says so). Tokens drawn after a sync carry the newer version, so a rollout that spans syncs is
fresher still. ``ahead=0`` is the synchronous loop: the same calls, in the same order.

Rollouts run in threads beside the caller's training: the server runs generate calls beside
training calls (docs/design/concurrency.md). Whatever ``rollout`` draws at random should come from
its step (a generator seeded by it), not from a shared one that rollouts in flight would interleave.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor


def run_ahead[T, M](steps: int, rollout: Callable[[int], T], train: Callable[[int, T], M],
                    ahead: int) -> Iterator[M]:
    """``train(i, rollout(i))`` for i in 0..steps-1, rollouts up to ``ahead`` steps ahead; yields each
    step's result of ``train``. A failed rollout fails its step; rollouts in flight when the loop
    ends early (an error, the caller stops iterating) are waited for, their results dropped."""
    if ahead < 0:
        raise ValueError(f"ahead must be >= 0, got {ahead}")
    with ThreadPoolExecutor(max(ahead, 1), thread_name_prefix="arctic-rollout") as pool:
        in_flight: deque[Future[T]] = deque()
        try:
            for step in range(steps):
                while len(in_flight) <= ahead and step + len(in_flight) < steps:
                    in_flight.append(pool.submit(rollout, step + len(in_flight)))
                yield train(step, in_flight.popleft().result())
        finally:
            for future in in_flight:
                future.cancel()  # those not started; the others end before the pool closes

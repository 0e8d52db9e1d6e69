"""PRIME-RL on the Arctic backend.

PRIME-RL runs as processes that speak over HTTP and files: its orchestrator (data, environments,
rewards, advantages, batching) asks an inference server for samples and hands packed micro-batches
to a trainer. ``arctic-primerl rl @ rl.toml`` keeps the orchestrator PRIME-RL's, unmodified, and
serves the other two sides from Arctic: :mod:`arctic_primerl.inference` answers PRIME-RL's inference
routes from Arctic's sampler, :mod:`arctic_primerl.trainer` reads its micro-batches and trains them
with ZoRRo through ``fwd_bwd`` / ``step``.
"""

from arctic_primerl.wire import PRIME_RL_COMMIT, PRIME_RL_VERSION

__all__ = ["PRIME_RL_COMMIT", "PRIME_RL_VERSION"]

"""The embedded sampling engine: continuous batching over a paged KV cache, prefix sharing, FCA decode."""

from arctic_fca.engine.engine import EmbeddedEngine, EngineOptions, GenerationOutput

__all__ = ["EmbeddedEngine", "EngineOptions", "GenerationOutput"]

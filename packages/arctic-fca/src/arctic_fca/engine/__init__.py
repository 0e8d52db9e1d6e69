"""The embedded sampling engine, one concept per module: ``engine`` (the loop and its options),
``scheduler`` (admission, KV blocks, forks), ``step_planner`` (a decode step's host side),
``model_runner`` (the model, its KV cache and forward passes), ``decoder`` (the model's layers as
fused kernels: ``fused_ops``, ``triton_ops``, and ``fused_linear`` for few-row products),
``cuda_graphs``, ``attention``, ``kv_cache``, ``blocks``, ``sampling``, ``sequence`` and ``requests``
(a caller's request in the shared batch)."""

from arctic_fca.engine.engine import EmbeddedEngine, EngineOptions, EngineStats
from arctic_fca.engine.requests import GenerationRequest, RequestCancelled
from arctic_fca.engine.sequence import GenerationOutput

__all__ = ["EmbeddedEngine", "EngineOptions", "EngineStats", "GenerationOutput", "GenerationRequest",
           "RequestCancelled"]

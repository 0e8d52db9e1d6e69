"""The ``vllm`` sampling backend: vLLM 0.24 with FCA as its decode attention.

- ``sampler``: :class:`~arctic_fca.vllm.sampler.VllmSampler`, the Arctic sampling backend ``vllm``
  (vLLM's ``AsyncLLM`` in process, every caller's requests in one batch, weight updates by CUDA
  IPC between two steps, FCA unless ``fca: false``).
- ``event_loop``: the asyncio loop, in a thread of its own, that ``AsyncLLM`` lives on.
- ``worker``: the extension mixed into vLLM's GPU worker (weights received, FCA statistics).
- ``plugin``: vLLM's ``vllm.general_plugins`` entry point; registers FCA as the CUSTOM backend.
- ``attention``: that backend, vLLM's FlashAttention or Triton backend with FCA decode
  (the only module here that imports vLLM at import time).
- ``fca``: FCA's additions to a backend's metadata builder and impl, free of vLLM imports.
- ``host_tables``: the host's block tables handed to those builders.

Inside this package ``import vllm`` is still vLLM itself (imports are absolute). Until arctic-fca
0.2.0 these modules were ``arctic_fca.vllm_sampler``, ``vllm_worker``, ...; those paths still
import, with a DeprecationWarning (``arctic_fca/__init__.py``).
"""

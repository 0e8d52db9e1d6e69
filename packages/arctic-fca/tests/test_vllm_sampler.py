"""The vllm sampling backend's gate: a missing or unsupported vLLM, or bad options, are refused by
name before any engine starts. (Generation through vLLM needs the GPU machine.)"""

from __future__ import annotations

import sys
import types

import pytest

from arctic_core.config import ModelConfig, SamplerConfig
from arctic_core.errors import ConfigError
from arctic_core.registry import default_registry


def build(options: dict | None = None):
    factory = default_registry().get("sampling_backend", "vllm")
    return factory(SamplerConfig(backend="vllm", options=options or {}), ModelConfig(path="policy"), seed=0)


def test_without_vllm_the_backend_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"needs vLLM 0\.24\.x: pip install 'arctic-fca\[vllm\]'"):
        build()


def test_another_vllm_release_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.33.0"))
    with pytest.raises(ConfigError, match=r"supports vLLM 0\.24\.x; this environment has 0\.33\.0"):
        build()


def test_bad_options_are_named():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        build({"gpu_memory_utilization": 2})

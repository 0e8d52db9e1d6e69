"""Fixtures of the arctic-verl tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from arctic_core.demo.task import CountingTask
from arctic_core.demo.tiny_model import save_tiny_policy


@pytest.fixture(scope="session")
def policy(tmp_path_factory) -> Path:
    """A tiny random Qwen3 policy with the demo's tokenizer (fp32)."""
    return save_tiny_policy(tmp_path_factory.mktemp("policy"), CountingTask().corpus())

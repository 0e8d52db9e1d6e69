"""Fixtures of the arctic-primerl tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from arctic_core.demo.task import CountingTask
from arctic_core.demo.tiny_model import save_tiny_policy

sys.path.insert(0, str(Path(__file__).parent))  # the helper modules beside the tests


@pytest.fixture(scope="session")
def policy(tmp_path_factory) -> Path:
    """A tiny random Qwen3 policy with the demo's tokenizer (fp32)."""
    return save_tiny_policy(tmp_path_factory.mktemp("policy"), CountingTask().corpus())

"""Shared fixtures: a tiny random Qwen3 policy saved once per test session."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # Ray workers use this checkout, nothing uploaded
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Qwen3 + tokenizer trained on the demo task's text (fp32, CPU)."""
    from arctic_core.demo.task import CountingTask
    from arctic_core.demo.tiny_model import save_tiny_policy

    return save_tiny_policy(tmp_path_factory.mktemp("policy"), CountingTask().corpus(), seed=0)


@pytest.fixture
def arctic_config(tiny_policy: Path, tmp_path: Path):
    from arctic_core.config import ArcticConfig

    def make(**overrides):
        data = {"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0}
        data.update(overrides)
        return ArcticConfig.from_dict(data)

    return make


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_policy: Path) -> Path:
    """A Hugging Face Hub cache holding the model ``arctic-test/tiny-policy`` (the tiny policy's
    files, laid out as huggingface_hub writes a snapshot), downloads off; its snapshot folder."""
    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--arctic-test--tiny-policy"
    shutil.copytree(tiny_policy, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / commit

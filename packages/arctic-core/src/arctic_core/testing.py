"""Pytest fixtures shared by every test suite of the workspace: the main one (``tests/`` and the
packages' tests) and the framework adapters', which run in environments of their own.

The repository's ``conftest.py`` registers this module (``pytest_plugins``), so each suite gets the
same tiny policy; a plugin's own test suite may register it the same way. Importing it needs pytest;
nothing else imports it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Qwen3 + tokenizer trained on the demo task's text (fp32, CPU, seed 0)."""
    from arctic_core.demo.task import CountingTask
    from arctic_core.demo.tiny_model import save_tiny_policy

    return save_tiny_policy(tmp_path_factory.mktemp("policy"), CountingTask().corpus(), seed=0)


@pytest.fixture(scope="session")
def policy(tiny_policy: Path) -> Path:
    """The tiny policy, under the name the framework adapters' tests use."""
    return tiny_policy


@pytest.fixture
def arctic_config(tiny_policy: Path, tmp_path: Path):
    """``make(**overrides)``: an ArcticConfig of the tiny policy on the CPU, seed 0, ``overrides``
    replacing whole top-level sections."""
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


def check_moved_module(old: str, new: str, message: str, monkeypatch: pytest.MonkeyPatch) -> list:
    """A module moved from ``old`` to ``new`` (``arctic_core._old_paths``) imports from its old path as
    a fresh process would: one DeprecationWarning matching ``message``, the same public objects, and
    no second warning on the next import. Returns the warnings caught."""
    import importlib
    import re
    import sys
    import warnings

    monkeypatch.delitem(sys.modules, old, raising=False)  # as in a process that has not imported it yet
    with pytest.warns(DeprecationWarning, match=re.escape(message)) as caught:
        module = importlib.import_module(old)
    moved = importlib.import_module(new)
    public = [name for name in vars(moved) if not name.startswith("_")]
    assert public and all(getattr(module, name) is getattr(moved, name) for name in public)
    assert set(public) <= set(module.__all__) and set(public) <= set(dir(module))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(old) is module  # once per process
    return list(caught)

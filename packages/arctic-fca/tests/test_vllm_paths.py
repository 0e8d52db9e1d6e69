"""The vLLM backend's modules moved into ``arctic_fca.vllm`` (arctic-fca 0.2.0): what vLLM and Arctic
load by name is at the new paths, and the old ``arctic_fca.vllm_*`` paths still import, through
arctic-core's old-path finder, as the same objects with one DeprecationWarning at the importing line.
No vLLM here: ``attention`` (the one module that imports vLLM) is imported over stand-in vLLM bases."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import sys
import types
from pathlib import Path

import pytest

import arctic_fca
import arctic_fca.vllm
from arctic_core.testing import check_moved_module

ROOT = Path(__file__).resolve().parents[3]

# Written out: moving or dropping one must fail here.
OLD_PATHS = {
    "arctic_fca.vllm_attention": "arctic_fca.vllm.attention",
    "arctic_fca.vllm_fca": "arctic_fca.vllm.fca",
    "arctic_fca.vllm_host_tables": "arctic_fca.vllm.host_tables",
    "arctic_fca.vllm_plugin": "arctic_fca.vllm.plugin",
    "arctic_fca.vllm_sampler": "arctic_fca.vllm.sampler",
    "arctic_fca.vllm_worker": "arctic_fca.vllm.worker",
}


def deprecation(old: str) -> str:
    return f"{old} is deprecated: it moved to {OLD_PATHS[old]}; import from there"


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """The three vLLM modules ``attention`` imports, with backends of a builder and an impl; the
    attention modules built over them are dropped afterwards."""
    def backend(name: str) -> type:
        builder, impl = type(f"{name}MetadataBuilder", (), {}), type(f"{name}Impl", (), {})
        return type(f"{name}Backend", (), {"get_builder_cls": staticmethod(lambda: builder),
                                           "get_impl_cls": staticmethod(lambda: impl)})

    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backend", "vllm.v1.attention.backends",
        "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.triton_attn")}
    modules["vllm.v1.attention.backend"].AttentionBackend = type("AttentionBackend", (), {})
    modules["vllm.v1.attention.backends.flash_attn"].FlashAttentionBackend = backend("FlashAttention")
    modules["vllm.v1.attention.backends.triton_attn"].TritonAttentionBackend = backend("TritonAttention")
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    attention = ("arctic_fca.vllm.attention", "arctic_fca.vllm_attention")
    for name in attention:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    for name in attention:
        sys.modules.pop(name, None)
    for package, attribute in ((arctic_fca.vllm, "attention"), (arctic_fca, "vllm_attention")):
        if attribute in vars(package):
            delattr(package, attribute)


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_path_imports_as_the_same_objects_and_warns_once(old, stand_in_vllm, monkeypatch):
    caught = check_moved_module(old, OLD_PATHS[old], deprecation(old), monkeypatch)
    assert all("arctic_core.plugins" not in str(w.message) for w in caught)  # that hint is arctic-core's


def test_the_old_paths_work_as_import_statements_and_warn_at_the_importing_line(monkeypatch):
    package = sys.modules["arctic_fca"]  # (the import statement below makes `arctic_fca` a local name)
    for old in ("arctic_fca.vllm_sampler", "arctic_fca.vllm_worker", "arctic_fca.vllm_fca"):
        monkeypatch.delitem(sys.modules, old, raising=False)
        monkeypatch.delattr(package, old.rpartition(".")[2], raising=False)  # else the attribute answers
    with pytest.warns(DeprecationWarning) as caught:
        import arctic_fca.vllm_worker
        from arctic_fca import vllm_fca
        from arctic_fca.vllm_sampler import VllmOptions, VllmSampler
    from arctic_fca.vllm import fca, sampler, worker

    assert (VllmSampler, VllmOptions) == (sampler.VllmSampler, sampler.VllmOptions)
    assert arctic_fca.vllm_worker.ArcticWorkerExtension is worker.ArcticWorkerExtension
    assert vllm_fca.FCABuilderMixin is fca.FCABuilderMixin and vllm_fca.HostStep is fca.HostStep
    assert {str(w.message).partition(" ")[0] for w in caught} == {
        "arctic_fca.vllm_worker", "arctic_fca.vllm_fca", "arctic_fca.vllm_sampler"}
    assert {w.filename for w in caught} == {__file__}


def test_what_vllm_and_arctic_load_by_name_is_at_the_new_paths(stand_in_vllm):
    from arctic_core.plugins.registry import default_registry
    from arctic_fca.vllm import attention, plugin, sampler, worker

    # vLLM's plugin entry point (the installed metadata: `uv sync` after a change of pyproject.toml).
    entry = {e.name: e for e in importlib.metadata.entry_points(group="vllm.general_plugins")}["arctic_fca_attention"]
    assert entry.value == "arctic_fca.vllm.plugin:register" and entry.load() is plugin.register
    # The attention backends the plugin registers and the worker extension the sampler names: vLLM
    # imports them by these paths, and they pickle by the module they name.
    assert set(plugin.BACKENDS.values()) == {"arctic_fca.vllm.attention.FCAAttentionBackend",
                                             "arctic_fca.vllm.attention.FCATritonAttentionBackend"}
    assert sampler.WORKER_EXTENSION == "arctic_fca.vllm.worker.ArcticWorkerExtension"
    for path in (*plugin.BACKENDS.values(), sampler.WORKER_EXTENSION):
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        assert cls.__module__ == module and getattr(sys.modules[module], cls.__qualname__) is cls, path
    assert attention.FCAAttentionBackend.get_impl_cls().__module__ == "arctic_fca.vllm.attention"
    assert worker.ArcticWorkerExtension.__module__ == "arctic_fca.vllm.worker"
    # Arctic's sampling backend "vllm" (the name in configs is unchanged).
    lazy = default_registry().provided("sampling_backend", "vllm").factory
    assert (lazy.target, lazy.options) == ("arctic_fca.vllm.sampler:VllmSampler", "arctic_fca.vllm.sampler:VllmOptions")
    assert lazy.load() is sampler.VllmSampler and lazy.options_model() is sampler.VllmOptions


def test_the_repository_imports_no_old_path():
    """Only this file imports them (``python -W error::DeprecationWarning`` must import the rest)."""
    sources = [*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("packages/*/tests/**/*.py"),
               *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/**/*.py"), *ROOT.glob("examples/**/*.py")]
    assert len(sources) > 50
    found = []
    for path in sources:
        if path == Path(__file__) or ".venv" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                      if any(name == old or name.startswith(f"{old}.") for old in OLD_PATHS)]
    assert not found

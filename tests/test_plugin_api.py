"""The plugin API stays put: the declared names, the old import paths of modules that moved, and a
plugin frozen at the first release's API (tests/plugins/arctic-first-api-plugin) that must keep
loading through its entry point and computing."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

import arctic_core.plugins
from arctic_core.batch import RolloutBatch
from arctic_core.config import LossTermConfig
from arctic_core.losses.objective import build_objective, build_processors, check_processor_outputs
from arctic_core.plugins.hookspecs import PROVIDER_HOOKS
from arctic_core.plugins.interfaces import LossContext
from arctic_core.plugins.registry import build_registry
from arctic_core.testing import check_moved_module

ROOT = Path(__file__).resolve().parents[1]
FROZEN = ROOT / "tests" / "plugins" / "arctic-first-api-plugin"
FROZEN_MODULE = "arctic_first_api_plugin"

# Written out rather than read from the code: moving or dropping a name must fail here, and a
# change to this list comes with a PLUGIN_API_VERSION decision (minor for additions, major else).
PLUGIN_API = {
    "hookimpl": "arctic_core.plugins.hookspecs",
    **dict.fromkeys(["TrainingBackendFactory", "LogProbBackendFactory", "SamplingBackendFactory",
                     "ProcessorFactory", "LossFactory", "WeightTransportFactory"], "arctic_core.plugins.hookspecs"),
    "Lazy": "arctic_core.plugins.registry",
    "ENTRY_POINT_GROUP": "arctic_core.plugins.registry",
    **dict.fromkeys(["TrainingBackend", "LogProbBackend", "SamplingBackend", "Processor", "LossTerm",
                     "WeightTransport", "WeightReceiver", "Objective", "LossContext", "Metrics", "NamedTensors"],
                    "arctic_core.plugins.interfaces"),
    "RolloutBatch": "arctic_core.batch",
    **dict.fromkeys(["ModelConfig", "TrainerConfig", "LogProbConfig", "SamplerConfig", "WeightSyncConfig",
                     "SamplingParams", "StrictModel", "validate", "validate_options"], "arctic_core.config"),
    **dict.fromkeys(["aggregate", "token_mean", "extreme"], "arctic_core.losses.aggregation"),
    **dict.fromkeys(["ArcticError", "BatchError", "ConfigError", "RequestError"], "arctic_core.errors"),
}
HOOKS = {"arctic_training_backends", "arctic_logprob_backends", "arctic_sampling_backends", "arctic_processors",
         "arctic_losses", "arctic_weight_transports"}

# Every module path of arctic-core 0.1.0 that has since moved, and where it went; then the later moves.
# (0.1.0's arctic_core.wire is not here: 0.3.0 moved the wire format back to that very path.)
OLD_PATHS = {
    "arctic_core.hookspecs": "arctic_core.plugins.hookspecs",
    "arctic_core.interfaces": "arctic_core.plugins.interfaces",
    "arctic_core.registry": "arctic_core.plugins.registry",
    "arctic_core.builtins": "arctic_core.plugins.builtins",
    "arctic_core.objective": "arctic_core.losses.objective",
    "arctic_core.processors": "arctic_core.losses.processors",
    "arctic_core.server": "arctic_core.serving.server",
    "arctic_core.http_server": "arctic_core.serving.http",
    "arctic_core.http_metrics": "arctic_core.serving.metrics",
    "arctic_core.ray_actors": "arctic_core.ray.actors",
    "arctic_core.ray_logprob": "arctic_core.ray.logprob",
    "arctic_core.ray_sampler": "arctic_core.ray.sampler",
    "arctic_core.ray_trainer": "arctic_core.ray.trainer",
    "arctic_core.weight_actor": "arctic_core.weights.actor",
    "arctic_core.weight_broadcast": "arctic_core.weights.broadcast",
    "arctic_core.weight_files": "arctic_core.weights.files",
    "arctic_core.weight_ipc": "arctic_core.weights.ipc",
    "arctic_core.weight_sync": "arctic_core.weights.inprocess",
    "arctic_core.serving.wire": "arctic_core.wire",  # 0.3.0
}


def deprecation(old: str) -> str:
    return f"{old} is deprecated: it moved to {OLD_PATHS[old]}"


# --------------------------------------------------------------------------- the declared surface
def test_the_plugin_api_is_the_declared_names_each_importable_from_where_it_is_defined():
    assert arctic_core.plugins.PLUGIN_API_VERSION == "1.1"
    assert arctic_core.plugins.API == PLUGIN_API
    assert set(arctic_core.plugins.__all__) == {"PLUGIN_API_VERSION", *PLUGIN_API}
    for name, module in PLUGIN_API.items():
        assert getattr(arctic_core.plugins, name) is getattr(importlib.import_module(module), name), name
    assert set(PROVIDER_HOOKS.values()) == HOOKS
    assert arctic_core.plugins.ENTRY_POINT_GROUP == "arctic"


def test_a_plugin_that_imports_only_the_hook_mark_and_lazy_imports_no_torch():
    """Listing plugins must stay cheap: a plugin module of Lazy factories loads no engine stack."""
    code = ("import sys; from arctic_core.plugins import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, Lazy, hookimpl; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- old import paths
@pytest.mark.parametrize("old", OLD_PATHS)
def test_a_moved_module_imports_from_its_old_path_as_the_same_objects_and_warns_once(old, monkeypatch):
    check_moved_module(old, OLD_PATHS[old], deprecation(old), monkeypatch)


def test_the_old_paths_work_as_an_import_statement_and_keep_a_renamed_class(monkeypatch):
    for old in ("arctic_core.hookspecs", "arctic_core.weight_sync"):
        monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning) as caught:
        import arctic_core.hookspecs
        from arctic_core.weight_sync import InProcessTransport
    assert arctic_core.hookspecs.hookimpl is arctic_core.plugins.hookimpl
    from arctic_core.weights.inprocess import InProcessWeightSync

    assert InProcessTransport is InProcessWeightSync
    assert {w.filename for w in caught} == {__file__}  # attributed to the importing line


def test_the_wire_format_moved_beside_the_protocol_and_its_serving_path_still_imports(monkeypatch):
    """0.3.0: ``arctic_core.serving.wire`` is ``arctic_core.wire`` (the client's transports speak it
    too); the form the code used, ``from arctic_core.serving import wire``, warns at its line, and
    0.1.0's ``arctic_core.wire`` is the module itself again, without a warning."""
    import arctic_core.serving

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from arctic_core import wire as current
    assert current.__name__ == "arctic_core.wire" and Path(current.__file__).parent.name == "arctic_core"
    monkeypatch.delitem(sys.modules, "arctic_core.serving.wire", raising=False)
    monkeypatch.delattr(arctic_core.serving, "wire", raising=False)  # else the package attribute answers
    with pytest.warns(DeprecationWarning, match=re.escape(deprecation("arctic_core.serving.wire"))) as caught:
        from arctic_core.serving import wire
    assert {w.filename for w in caught} == {__file__}
    assert wire.encode is current.encode and wire.decode_request is current.decode_request
    assert wire._tensor_fields is current._tensor_fields and wire.CONTENT_TYPE == current.CONTENT_TYPE


def test_the_packages_import_no_old_path():
    """Their own imports must never warn (``python -W error::DeprecationWarning`` imports them)."""
    sources = [*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("examples/*/src/**/*.py")]
    assert len(sources) > 50
    found = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                      if any(name == old or name.startswith(f"{old}.") for old in OLD_PATHS)]
    assert not found


# --------------------------------------------------------------------------- the frozen plugin
def install_frozen_plugin(root: Path) -> None:
    """Leave in ``root`` what installing the frozen plugin would: a dist-info folder with its
    metadata and the entry points its pyproject declares (its sources are found on the path)."""
    project = tomllib.loads((FROZEN / "pyproject.toml").read_text())["project"]
    info = root / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    entries = "".join(f"{name} = {target}\n" for name, target in project["entry-points"]["arctic"].items())
    (info / "entry_points.txt").write_text(f"[arctic]\n{entries}")


@pytest.fixture
def frozen_plugin(tmp_path, monkeypatch):
    install_frozen_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(FROZEN / "src"))
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in (FROZEN_MODULE, "arctic_core.hookspecs", "arctic_core.interfaces"):
        monkeypatch.delitem(sys.modules, module, raising=False)  # imported afresh, so it warns again
    yield
    sys.modules.pop(FROZEN_MODULE, None)


def test_a_plugin_written_against_the_first_api_loads_through_its_entry_point_and_computes(frozen_plugin):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = build_registry()
    plugin = sys.modules[FROZEN_MODULE]
    ours = {(str(w.message).split(";")[0], w.filename) for w in caught
            if issubclass(w.category, DeprecationWarning) and "is deprecated: it moved to" in str(w.message)}
    # One warning per old path, each at the plugin's own import line.
    assert ours == {(deprecation(old), plugin.__file__) for old in ("arctic_core.hookspecs", "arctic_core.interfaces")}
    assert registry.provided("loss", "first_api_reinforce").plugin == "first_api"
    assert registry.provided("processor", "first_api_top1_match").plugin == "first_api"
    assert plugin.hookimpl is arctic_core.plugins.hookimpl and plugin.LossContext is LossContext

    # Two responses, one padded; the values are binary fractions, so every order of summing is exact.
    batch = RolloutBatch.from_lists([[1], [4, 5]], [[2, 3, 7], [6]], [0, 1], advantages=torch.tensor([2.0, -1.0]))
    logprobs = torch.tensor([[-1.0, -3.0, -0.5], [-2.0, 0.0, 0.0]], requires_grad=True)
    ctx = LossContext.of(batch)
    advantages = torch.tensor([2.0, -1.0])[:, None] - 0.5
    plain = -(advantages * logprobs * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert plain.item() == 0.9375
    loss, metrics = registry.get("loss", "first_api_reinforce")(baseline=0.5)({"logprobs": logprobs}, batch, ctx)
    assert torch.equal(loss, plain) and metrics == {}
    # As the server runs it: resolved by name with its options, checked, composed with its processor.
    objective = build_objective(registry, [LossTermConfig(name="first_api_reinforce", baseline=0.5)])
    objective.check(batch, ctx)
    total, metrics = objective({"logprobs": logprobs}, batch, ctx)
    assert total.item() == metrics["first_api_reinforce/loss"] == 0.9375
    (gradient,) = torch.autograd.grad(total, logprobs)
    assert torch.equal(gradient, -advantages * batch.loss_mask / 4)

    processors = build_processors(registry, ["first_api_top1_match"], temperature=0.7)
    processor = processors["first_api_top1_match"]
    logits, targets = torch.tensor([[0.0, 2.0], [3.0, 1.0], [1.0, 5.0]]), torch.tensor([1, 1, 0])
    produced = processor(logits, targets)
    check_processor_outputs(processor, produced, tokens=3)
    assert produced["first_api_top1_match"].tolist() == [1.0, 0.0, 0.0]


def test_the_first_api_plugin_is_listed_by_the_cli_with_the_warning_at_its_import(tmp_path):
    """In a fresh process, through the installed entry point, as a user would run it."""
    install_frozen_plugin(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(FROZEN / "src")])}
    listed = subprocess.run([sys.executable, "-W", "default::DeprecationWarning", "-m", "arctic_core.cli", "plugins"],
                            capture_output=True, text=True, env=env)
    assert listed.returncode == 0, listed.stderr
    assert "first_api_reinforce" in listed.stdout and "first_api_top1_match" in listed.stdout
    source = FROZEN / "src" / FROZEN_MODULE / "__init__.py"
    line = source.read_text().splitlines().index("from arctic_core.hookspecs import hookimpl") + 1
    assert f"{source}:{line}: DeprecationWarning: {deprecation('arctic_core.hookspecs')}" in listed.stderr


def test_a_config_naming_the_torch_backend_by_its_first_name_builds_that_backend_and_warns(tiny_policy):
    """arctic-zorro 0.1.0 called the plain-torch backend ``reference`` (module ``arctic_zorro.reference``):
    such a config still trains on the very ``torch`` backend, and the old module gives its classes,
    each with a DeprecationWarning naming the new name; listings show only the current name."""
    from arctic_core.client import ArcticClient
    from arctic_zorro.torch_backend import TorchLogProbEngine, TorchTrainer

    config = {"model": {"path": str(tiny_policy), "device": "cpu"}, "trainer": {"backend": "reference"},
              "reference": {"backend": "reference"}}
    with pytest.warns(DeprecationWarning, match="backend name 'reference' is deprecated: use 'torch'"):
        client = ArcticClient.in_process(config)
    with client:
        server = client.transport.server
        assert type(server.trainer) is TorchTrainer and type(server.reference) is TorchLogProbEngine
        batch = RolloutBatch.from_lists([[5, 6, 7]], [[8, 9], [10]], [0, 0])
        assert client.log_probs(batch, model="reference").outputs["logprobs"].shape == (2, 2)
    assert "reference" not in build_registry().names("training_backend")
    sys.modules.pop("arctic_zorro.reference", None)  # the module warns at its first import
    with pytest.warns(DeprecationWarning, match="arctic_zorro.reference are deprecated"):
        from arctic_zorro.reference import ReferenceLogProbEngine, ReferenceTrainer
    assert (ReferenceTrainer, ReferenceLogProbEngine) == (TorchTrainer, TorchLogProbEngine)

"""Plugin discovery through real installed entry points, and errors for unknown names (found before
any engine loads)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import types

import pytest

import arctic_core
from arctic_core.config import ArcticConfig
from arctic_core.config_docs import BUILTIN_PLUGINS, PRODUCT_SECTIONS, config_reference
from arctic_core.errors import ConfigError, PluginConflictError, PluginError, PluginNotFoundError
from arctic_core.plugins.checks import check_plugins
from arctic_core.plugins.hookspecs import hookimpl
from arctic_core.plugins.registry import (Lazy, build_registry, default_registry, installed_entry_points,
                                         unmet_requirements)
from arctic_core.serving.server import ArcticServer
from arctic_zorro.torch_backend import TorchTrainer


def test_installed_entry_points_include_builtins_and_the_example_plugin():
    names = {ep.name: ep.value for ep in installed_entry_points()}
    assert names["example"] == "arctic_example_plugin"  # a separate installed distribution
    assert {"core", "zorro", "fca"} <= set(names)


def test_registry_indexes_every_kind_with_its_provider():
    registry = default_registry()
    assert {"ppo", "gspo", "kl", "entropy", "sft", "reinforce"} <= set(registry.names("loss"))
    assert {"logprobs", "entropy", "top1_match"} <= set(registry.names("processor"))
    assert registry.names("training_backend") == ["deepspeed", "ray", "torch"]
    assert registry.names("sampling_backend") == ["embedded", "hf-generate", "ray", "vllm"]
    assert registry.names("logprob_backend") == ["deepspeed", "ray", "torch"]
    assert registry.names("weight_transport") == ["cuda-ipc", "inprocess", "safetensors-files", "torch-broadcast"]
    providers = {(p.kind, p.name): p.plugin for p in registry.all()}
    assert providers[("loss", "reinforce")] == "example"
    assert providers[("processor", "top1_match")] == "example"
    assert providers[("training_backend", "torch")] == "zorro"
    assert providers[("training_backend", "ray")] == "core"
    assert providers[("sampling_backend", "embedded")] == "fca"
    assert providers[("sampling_backend", "ray")] == providers[("weight_transport", "torch-broadcast")] == "core"


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(PluginNotFoundError) as info:
        default_registry().get("loss", "ppo2")
    message = str(info.value)
    assert "no loss named 'ppo2' is registered (did you mean 'ppo'?); registered: cispo," in message
    assert "reinforce" in message
    with pytest.raises(PluginNotFoundError, match="unknown plugin kind"):
        default_registry().get("optimizer", "adam")


def test_kinds_are_the_documented_provider_hooks():
    from arctic_core.plugins import hookspecs
    from arctic_core.plugins.registry import KINDS

    assert KINDS == {"training_backend": "arctic_training_backends", "logprob_backend": "arctic_logprob_backends",
                     "sampling_backend": "arctic_sampling_backends", "processor": "arctic_processors",
                     "loss": "arctic_losses", "weight_transport": "arctic_weight_transports"}
    for hook in KINDS.values():
        spec = getattr(hookspecs, hook)
        assert ":return: ``{name: factory}``" in spec.__doc__, hook
        assert "Factory" in str(spec.__annotations__["return"]), hook  # a typed factory protocol


def test_a_missing_default_backend_names_the_package_that_provides_it():
    from arctic_core.plugins.registry import Registry

    empty = Registry(manager=None)  # as if only arctic-core were installed
    with pytest.raises(PluginNotFoundError, match="no training backend named 'deepspeed'.*pip install arctic-zorro"):
        empty.get("training_backend", "deepspeed")
    with pytest.raises(PluginNotFoundError, match="no sampling backend named 'embedded'.*pip install arctic-fca"):
        empty.get("sampling_backend", "embedded")


def test_the_public_names_import_from_the_package_root_without_torch():
    code = ("import sys, arctic_core; assert 'torch' not in sys.modules; "
            "from arctic_core import ArcticClient, ArcticConfig, RolloutBatch, hookimpl, TrainingBackend, Lazy; "
            "print(ArcticClient.__module__, RolloutBatch.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["arctic_core.client", "arctic_core.batch"]
    assert set(arctic_core._LAZY) <= set(arctic_core.__all__)  # __all__ is spelt out: it names each lazy one


def test_two_plugins_claiming_one_name_conflict():
    clash = types.ModuleType("clash")
    clash.arctic_losses = hookimpl(lambda: {"ppo": object})
    with pytest.raises(PluginConflictError, match="'ppo' is provided by both plugin 'core' and 'clash'"):
        build_registry({"clash": clash})
    with pytest.raises(PluginConflictError, match="plugin name 'core' is an installed entry point's"):
        build_registry({"core": types.ModuleType("mine")})  # would silently replace Arctic's own


def test_example_plugin_loss_and_processor_run():
    import torch

    from arctic_core.batch import RolloutBatch
    from arctic_core.plugins.interfaces import LossContext

    registry = default_registry()
    processor = registry.get("processor", "top1_match")()
    logits = torch.tensor([[0.0, 2.0], [3.0, 1.0]])
    assert processor(logits, torch.tensor([1, 1]))["top1_match"].tolist() == [1.0, 0.0]
    batch = RolloutBatch.from_lists([[1]], [[2, 3]], [0], advantages=torch.tensor([2.0]))
    logp = torch.tensor([[-1.0, -3.0]])
    loss, _ = registry.get("loss", "reinforce")()({"logprobs": logp}, batch, LossContext.of(batch))
    assert loss.item() == pytest.approx(-(2.0 * -1.0 + 2.0 * -3.0) / 2)
    loss, _ = registry.get("loss", "reinforce")(baseline=1.5)({"logprobs": logp}, batch, LossContext.of(batch))
    assert loss.item() == pytest.approx(-(0.5 * -1.0 + 0.5 * -3.0) / 2)


def test_the_example_loss_validates_its_options_as_the_guide_says():
    """A typo in a term's options is a config error naming the option and the closest one (a 400
    for an HTTP client), and the reference lists the options the term takes."""
    reinforce = default_registry().get("loss", "reinforce")
    with pytest.raises(ConfigError, match=r"options of loss 'reinforce':\n  basline: unknown key "
                                          r"\(did you mean 'baseline'\?\)"):
        reinforce(basline=0.1)
    with pytest.raises(ConfigError, match="baseline: Input should be a finite number"):
        reinforce(baseline=float("nan"))
    reference = config_reference(default_registry(), ["example"])
    assert "| `baseline` | float | `0.0` | Subtracted from every advantage. |" in reference


def test_the_reference_lists_the_options_of_every_product_that_declares_them():
    """Backends, loss terms and weight transports alike: each product whose options model has a
    field is in the generated reference with each of its keys."""
    registry = default_registry()
    reference = config_reference(registry, BUILTIN_PLUGINS)
    declared = [(item, item.options_model()) for item in registry.all() if item.plugin in BUILTIN_PLUGINS]
    documented = [(item, model) for item, model in declared if model is not None and model.model_fields]
    assert {"safetensors-files", "torch-broadcast"} <= {item.name for item, _ in documented}
    for item, model in documented:
        kind_section = reference.split(f"\n## {PRODUCT_SECTIONS[item.kind][0]}\n", 1)[1].split("\n## ", 1)[0]
        section = kind_section.split(f"### `{item.name}` ({item.plugin}):", 1)[1].split("\n### ", 1)[0]
        for key in model.model_fields:
            assert f"| `{key}` |" in section, (item.kind, item.name, key)


def test_cli_lists_builtins_and_the_example_plugin():
    out = subprocess.run(
        [sys.executable, "-m", "arctic_core.cli", "plugins"], capture_output=True, text=True, check=True
    ).stdout
    for expected in ("core", "example", "reinforce", "top1_match", "hf-generate", "torch", "inprocess"):
        assert expected in out


def test_resolving_plugins_imports_no_engine():
    """Engines are Lazy factories: listing plugins or resolving a loss never imports transformers."""
    code = (
        "import sys; from arctic_core.plugins.registry import default_registry; r = default_registry(); "
        "r.get('loss', 'ppo'); r.get('training_backend', 'torch'); print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_plugin_and_its_options_are_checked_before_an_engine_is_built_and_a_failed_start_frees_what_it_built(
        tiny_policy, monkeypatch):
    built, freed = [], []
    build = ArcticServer._build

    def build_sampler_fails(self, kind, *args):
        built.append(kind)
        if kind == "sampling_backend":
            raise RuntimeError("the sampler failed to start")
        return build(self, kind, *args)

    monkeypatch.setattr(ArcticServer, "_build", build_sampler_fails)
    monkeypatch.setattr(TorchTrainer, "shutdown", lambda self: freed.append(type(self).__name__))
    model = {"path": str(tiny_policy), "device": "cpu"}
    bad = {"weight_sync": {"transport": "nope"}, "sampler": {"options": {"bogus": 1}},
           "trainer": {"backend": "ray", "options": {"backend": "torch", "options": {"zoro": {}}}}}
    errors = (PluginNotFoundError, ConfigError, ConfigError)
    messages = ("no weight transport named 'nope'", "sampler.options.bogus",
                r"trainer.options.options.zoro: unknown key \(did you mean 'zorro'")
    for (key, value), error, message in zip(bad.items(), errors, messages, strict=True):
        config = {"model": model, "trainer": {"backend": "torch"}, key: value}
        with pytest.raises(error, match=message):
            ArcticServer(ArcticConfig.from_dict(config))
    assert built == []  # a real model would have taken minutes to load before the typo was found
    with pytest.raises(RuntimeError, match="the sampler failed to start"):
        ArcticServer(ArcticConfig.from_dict({"model": model, "trainer": {"backend": "torch"}}))
    assert built == ["training_backend", "sampling_backend"] and freed == ["TorchTrainer"]


def test_each_declared_options_model_is_the_products_own():
    """``Lazy(options=...)`` names the model the product validates with: the two never drift apart."""
    declared = [item for item in default_registry().all() if isinstance(item.factory, Lazy) and item.factory.options]
    assert len(declared) >= 10
    for item in declared:
        assert item.factory.load().options_model is item.options_model(), (item.kind, item.name)


def test_options_are_checked_without_importing_an_engine():
    """A config is checked from the options models the plugins declare (``Lazy(options=...)``):
    DeepSpeed is not imported (importing it picks an accelerator and sets launcher variables)."""
    code = (
        "import sys; from arctic_core.config import ArcticConfig; "
        "from arctic_core.plugins.checks import check_plugins; "
        "from arctic_core.plugins.registry import default_registry\n"
        "config = ArcticConfig.from_dict({'model': {'path': 'm'}, 'trainer': {'options': {'zero_stge': 2}}})\n"
        "try:\n    check_plugins(config, default_registry())\nexcept Exception as exc:\n    print(exc)\n"
        "print('deepspeed' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "trainer.options.zero_stge: unknown key (did you mean 'zero_stage'?)" in out
    assert out.strip().splitlines()[-1] == "False"


GOOD_PLUGIN = '''
from arctic_core import hookimpl
from arctic_core.config import StrictModel


class ScaledOptions(StrictModel):
    factor: float = 2.0
    """What the log-probs are multiplied by."""


class Scaled:
    """A third party's loss term: factor times the mean log-prob."""

    options_model = ScaledOptions
    requires = ("logprobs",)


class ChunkedCopyOptions(StrictModel):
    chunk_mb: int = 64
    """Megabytes copied at a time."""


class ChunkedCopy:
    """A third party's weight transport: copies in chunks."""

    options_model = ChunkedCopyOptions


@hookimpl
def arctic_losses():
    return {"scaled_logprob": Scaled}


@hookimpl
def arctic_weight_transports():
    return {"chunked-copy": ChunkedCopy}
'''


def install(root, package: str, entry_name: str, source: str, requires: tuple[str, ...] = ()) -> None:
    """A package installed as pip would leave it: its module and a dist-info folder holding its
    ``arctic`` entry point (found by importlib.metadata on the path) and its ``Requires-Dist``."""
    (root / f"{package}.py").write_text(source)
    info = root / f"{package}-0.1.dist-info"
    info.mkdir()
    requires_dist = "".join(f"Requires-Dist: {line}\n" for line in requires)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n{requires_dist}")
    (info / "entry_points.txt").write_text(f"[arctic]\n{entry_name} = {package}\n")


def cli(root, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-m", "arctic_core.cli", *args], capture_output=True, text=True, env=env)


@pytest.mark.slow
def test_a_third_party_plugin_is_listed_with_its_options(tmp_path):
    install(tmp_path, "thirdp", "thirdp", GOOD_PLUGIN)
    listed = cli(tmp_path, "plugins")
    assert listed.returncode == 0 and "scaled_logprob" in listed.stdout and "thirdp" in listed.stdout
    reference = cli(tmp_path, "config-reference").stdout
    assert "### `scaled_logprob` (thirdp): A third party's loss term: factor times the mean log-prob." in reference
    assert "What the log-probs are multiplied by." in reference
    assert "### `chunked-copy` (thirdp): A third party's weight transport: copies in chunks." in reference
    assert "| `chunk_mb` | int | `64` | Megabytes copied at a time. |" in reference
    assert "scaled_logprob" not in cli(tmp_path, "config-reference", "--builtin").stdout


@pytest.mark.parametrize("case", ["entry point taken", "import fails", "misspelt hook", "hook answers a list",
                                  "hook fails", "factory not callable", "name not a name",
                                  "hook not marked"])
def test_a_broken_or_clashing_plugin_is_refused_by_name(tmp_path, case):
    source, entry_name, expected = {
        "entry point taken": (GOOD_PLUGIN, "example", "two packages name their 'arctic' entry point 'example': "
                              "arctic_example_plugin from arctic-example-plugin and thirdp from thirdp; rename one"),
        "import fails": ("1 / 0", "thirdp", "plugin 'thirdp' (thirdp from thirdp) fails to import: "
                         "ZeroDivisionError: division by zero"),
        "misspelt hook": ("from arctic_core import hookimpl\n\n@hookimpl\ndef arctic_loss():\n    return {}\n",
                          "thirdp", "plugin 'thirdp': unknown hook 'arctic_loss'"),
        "hook answers a list": ("from arctic_core import hookimpl\n\n@hookimpl\ndef arctic_losses():\n"
                                "    return [\"my_loss\"]\n",
                                "thirdp", "plugin 'thirdp': arctic_losses must return a dict of name -> factory, "
                                "got list"),
        "hook fails": ("from arctic_core import hookimpl\n\n@hookimpl\ndef arctic_losses():\n    raise KeyError('x')\n",
                       "thirdp", "plugin 'thirdp': its arctic_losses hook failed: KeyError"),
        "factory not callable": ("from arctic_core import hookimpl\n\n@hookimpl\ndef arctic_losses():\n"
                                 "    return {'strloss': 'thirdp:Loss'}\n", "thirdp",
                                 "plugin 'thirdp': arctic_losses provides 'strloss' as a str; a factory must be "
                                 "callable, e.g. a class or Lazy("),
        "name not a name": ("from arctic_core import hookimpl\n\n@hookimpl\ndef arctic_losses():\n"
                            "    return {' spaced': object}\n", "thirdp",
                            "plugin 'thirdp': arctic_losses provides a product named ' spaced'; a name is a "
                            "non-empty string"),
        "hook not marked": ("def arctic_losses():\n    return {'undecorated': object}\n", "thirdp",
                            "plugin 'thirdp': arctic_losses is not marked @hookimpl, so it would be ignored; "
                            "decorate it with @hookimpl"),
    }[case]
    install(tmp_path, "thirdp", entry_name, source)
    result = cli(tmp_path, "plugins")
    assert result.returncode != 0
    assert expected in result.stderr and "Traceback" not in result.stderr


BROKEN_LAZY_PLUGIN = '''
from arctic_core import Lazy, hookimpl


@hookimpl
def arctic_training_backends():
    return {"lazyt": Lazy("lazybad_engine:Trainer", "A trainer whose options model is missing.",
                          options="missing_mod:Opts")}


@hookimpl
def arctic_losses():
    return {"lazyloss": Lazy("lazybad_engine:Loss", "A loss whose module is missing.")}
'''


def test_a_broken_lazy_names_its_plugin_and_product_and_hides_no_other_plugin(tmp_path):
    """A Lazy whose options model or target cannot be imported fails as that plugin's product (at the
    config check, or when the server builds it), and the reference marks it and lists the rest."""
    module = types.ModuleType("lazybad")
    exec(BROKEN_LAZY_PLUGIN, module.__dict__)
    registry = build_registry({"lazybad": module})
    config = ArcticConfig.from_dict({"model": {"path": "m"}, "trainer": {"backend": "lazyt"}})
    with pytest.raises(PluginError, match="training backend 'lazyt' of plugin 'lazybad': its options model "
                                          "'missing_mod:Opts' cannot be imported: ModuleNotFoundError"):
        check_plugins(config, registry)
    with pytest.raises(PluginError, match="loss 'lazyloss' of plugin 'lazybad': its target 'lazybad_engine:Loss' "
                                          "cannot be imported: ModuleNotFoundError"):
        registry.get("loss", "lazyloss")()
    install(tmp_path, "lazybad", "lazybad", BROKEN_LAZY_PLUGIN)
    install(tmp_path, "thirdp", "thirdp", GOOD_PLUGIN)
    reference = cli(tmp_path, "config-reference")
    assert reference.returncode == 0, reference.stderr
    assert "Megabytes copied at a time." in reference.stdout and "### `torch` (zorro)" in reference.stdout
    assert ("### `lazyt` (lazybad): A trainer whose options model is missing.\n\n**Options unavailable**: "
            "training backend 'lazyt' of plugin 'lazybad': its options model 'missing_mod:Opts'") in reference.stdout


NEEDY_PLUGIN = '''
from arctic_core import Lazy, hookimpl


@hookimpl
def arctic_sampling_backends():
    return {"fast": Lazy("fastsamp_engine:Sampler", "A sampler on an optional stack.", needs="fastsamp[gpu]")}
'''


@pytest.mark.slow
def test_a_backend_whose_optional_packages_are_missing_is_refused_before_any_engine_is_built(tmp_path):
    """A backend's ``needs`` (its extra's packages, with the versions its metadata states) are
    checked with the config: an uninstalled or wrong-version package is named with what to install,
    before the trainer spends minutes loading; ``arctic-rl plugins`` shows it too."""
    requires = ("pydantic>=2", "not-a-real-package>=1.2; extra == 'gpu'", "pydantic<2; extra == 'gpu'",
                "typer<0.1; extra == 'other'")
    install(tmp_path, "fastsamp", "fastsamp", NEEDY_PLUGIN, requires)
    code = ("from arctic_core.config import ArcticConfig; from arctic_core.plugins.checks import check_plugins\n"
            "from arctic_core.plugins.registry import default_registry\n"
            "config = ArcticConfig.from_dict({'model': {'path': 'm'}, 'sampler': {'backend': 'fast'}})\n"
            "check_plugins(config, default_registry())\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    checked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    found = importlib.metadata.version("pydantic")
    expected = (f"sampling backend 'fast' needs not-a-real-package>=1.2 (not installed); pydantic<2 (found {found}): "
                "pip install 'fastsamp[gpu]'")
    assert checked.returncode != 0 and f"ConfigError: {expected}" in checked.stderr
    assert "fastsamp_engine" not in checked.stderr  # refused before the engine's module is imported
    listed = cli(tmp_path, "plugins")
    assert listed.returncode == 0 and "not-a-real-package>=1.2 (not installed)" in " ".join(listed.stdout.split())


def test_the_vllm_sampler_states_what_it_needs():
    """The names the guides use declare their optional stacks (checked against the environment)."""
    registry = default_registry()
    assert registry.provided("sampling_backend", "vllm").needs == "arctic-fca[vllm]"
    assert {registry.provided(kind, "ray").needs for kind in ("training_backend", "logprob_backend",
                                                              "sampling_backend")} == {"arctic-core[ray]"}
    assert unmet_requirements("arctic-core[ray]") == []  # installed in the test environment

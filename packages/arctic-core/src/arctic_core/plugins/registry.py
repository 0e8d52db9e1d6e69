"""Plugin discovery: load every ``arctic`` entry point and index what each provides, by kind and name."""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pluggy
from packaging.requirements import Requirement

from arctic_core.plugins import hookspecs
from arctic_core.errors import ConfigError, PluginConflictError, PluginError, PluginNotFoundError

ENTRY_POINT_GROUP = "arctic"

KINDS: dict[str, str] = hookspecs.PROVIDER_HOOKS
"""Plugin kind -> the provider hook that answers it (declared in :mod:`arctic_core.plugins.hookspecs`)."""

PROVIDED_BY: dict[tuple[str, str], str] = {
    ("training_backend", "deepspeed"): "arctic-zorro",
    ("training_backend", "torch"): "arctic-zorro",
    ("logprob_backend", "deepspeed"): "arctic-zorro",
    ("logprob_backend", "torch"): "arctic-zorro",
    ("sampling_backend", "embedded"): "arctic-fca",
    ("sampling_backend", "hf-generate"): "arctic-fca",
    ("sampling_backend", "vllm"): "arctic-fca[vllm]",
}
"""Where the names the config's defaults and guides use come from, for the error when one is
missing (the core itself imports none of these packages)."""


@dataclass(frozen=True)
class Lazy:
    """A factory named ``"module:attribute"``, imported on first call.

    Plugins whose products pull in heavy stacks (transformers, deepspeed, vllm) return these, so
    listing plugins or resolving a loss never imports an engine.
    """

    target: str
    summary: str
    options: str | None = None
    """``"module:attribute"`` of the options model, in a module light to import: a config's options
    are then checked before any engine module is imported (None: when the product is built)."""
    needs: str | None = None
    """The optional dependencies the product imports, as a pip requirement with extras
    (``"arctic-fca[vllm]"``): the extra's packages are checked against the installed versions
    before any engine is built, so a missing one fails at once rather than after the others load."""
    renamed_to: str | None = None
    """Set on an old name kept working: the product's current name. Looking the old name up warns
    (DeprecationWarning) and gives this product; listings and errors show only the current name."""
    product: str = field(default="", compare=False, repr=False)
    """What it is registered as (``"loss 'x' of plugin 'y'"``), set by the registry so that an
    import failure names the product and its plugin rather than only a module."""

    def load(self) -> Callable[..., Any]:
        return self._resolve(self.target, "target")

    def options_model(self) -> type | None:
        return self._resolve(self.options, "options model") if self.options else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def _resolve(self, target: str, role: str) -> Any:
        # Any exception: importing a plugin's module may raise anything, and a bare traceback from
        # deep inside an import names neither the plugin nor the product the config asked for.
        try:
            return _resolve(target)
        except Exception as exc:
            owner = self.product or f"Lazy({self.target!r})"
            raise PluginError(f"{owner}: its {role} {target!r} cannot be imported: {type(exc).__name__}: {exc} "
                              f"(a Lazy's {role} must be an importable 'module:attribute')") from exc


def _resolve(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Provided:
    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str

    @property
    def summary(self) -> str:
        if isinstance(self.factory, Lazy):
            return self.factory.summary
        first_paragraph = (self.factory.__doc__ or "").strip().split("\n\n")[0]
        return " ".join(line.strip() for line in first_paragraph.splitlines())

    def options_model(self) -> type | None:
        """The model of this product's ``options`` (its factory's ``options_model``), without
        importing a lazy product's module; None where it declares none."""
        if isinstance(self.factory, Lazy):
            return self.factory.options_model()
        return getattr(self.factory, "options_model", None)

    @property
    def needs(self) -> str | None:
        return self.factory.needs if isinstance(self.factory, Lazy) else None

    def missing(self) -> str | None:
        """What of the product's ``needs`` this environment lacks, and what to install; None when
        nothing is missing."""
        unmet = unmet_requirements(self.needs) if self.needs else []
        return f"{'; '.join(unmet)}: pip install '{self.needs}'" if unmet else None

    def check_installed(self) -> None:
        """Raise :class:`~arctic_core.errors.ConfigError` naming each package of the product's
        ``needs`` that is missing or of another version, and what to install."""
        missing = self.missing()
        if missing:
            raise ConfigError(f"{self.kind.replace('_', ' ')} {self.name!r} needs {missing}")


def unmet_requirements(needs: str) -> list[str]:
    """The packages an installed distribution's extras (``"arctic-fca[vllm]"``) require that this
    environment lacks, each as ``"vllm>=0.24,<0.25 (not installed)"`` or ``"... (found 0.23.1)"``;
    the versions come from the distribution's own metadata, so they are stated once, in its
    pyproject."""
    wanted = Requirement(needs)
    try:
        requirements = [Requirement(line) for line in importlib.metadata.requires(wanted.name) or []]
    except importlib.metadata.PackageNotFoundError:  # run from a source tree: the build will tell
        return []
    unmet = []
    for requirement in requirements:
        marker = requirement.marker
        if marker is None or not any(marker.evaluate({"extra": extra}) for extra in wanted.extras):
            continue  # a base dependency (installed with the distribution) or another extra's
        try:
            found = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{requirement.name}{requirement.specifier} (not installed)")
            continue
        if not requirement.specifier.contains(found, prereleases=True):
            unmet.append(f"{requirement.name}{requirement.specifier} (found {found})")
    return unmet


@dataclass
class Registry:
    """Everything the installed plugins provide, looked up by ``(kind, name)``."""

    manager: pluggy.PluginManager
    entries: dict[str, dict[str, Provided]] = field(default_factory=dict)

    def get(self, kind: str, name: str) -> Callable[..., Any]:
        """The factory registered as ``name`` for ``kind``; the error lists the known names."""
        return self.provided(kind, name).factory

    def provided(self, kind: str, name: str) -> Provided:
        """What is registered as ``name`` for ``kind``; the error lists the known names."""
        if kind not in KINDS:
            raise PluginNotFoundError(f"unknown plugin kind {kind!r}; kinds: {sorted(KINDS)}")
        found = self.entries.get(kind, {}).get(name)
        if found is None:
            names = sorted(self.entries.get(kind, {}))
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            package = PROVIDED_BY.get((kind, name))
            install = f" `pip install {package}` provides it." if package else ""
            raise PluginNotFoundError(
                f"no {kind.replace('_', ' ')} named {name!r} is registered{hint}; registered: "
                f"{', '.join(names) or '(none)'}.{install} "
                f"Plugins come from the '{ENTRY_POINT_GROUP}' entry-point group (arctic-rl plugins lists them)."
            )
        renamed_to = getattr(found.factory, "renamed_to", None)
        if renamed_to:
            warnings.warn(f"the {kind.replace('_', ' ')} name {name!r} is deprecated: use {renamed_to!r}",
                          DeprecationWarning, stacklevel=2)
        return found

    def names(self, kind: str) -> list[str]:
        """The current names registered for ``kind`` (old names kept working are left out)."""
        return sorted(name for name, p in self.entries.get(kind, {}).items() if not _is_old_name(p))

    def all(self) -> list[Provided]:
        return [p for kind in KINDS for p in sorted(self.entries.get(kind, {}).values(), key=lambda p: p.name)
                if not _is_old_name(p)]


def _is_old_name(provided: Provided) -> bool:
    return bool(getattr(provided.factory, "renamed_to", None))


def build_registry(extra_plugins: dict[str, object] | None = None) -> Registry:
    """Load the ``arctic`` entry points (plus ``extra_plugins``, e.g. in tests) and index them."""
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    plugins = _load_entry_points()
    for name, module in (extra_plugins or {}).items():
        if name in plugins:
            raise PluginConflictError(f"plugin name {name!r} is an installed entry point's; choose another")
        plugins[name] = module
    for name, module in plugins.items():
        _refuse_unmarked_hooks(manager, name, module)
        try:
            manager.register(module, name=name)
        except pluggy.PluginValidationError as exc:  # a hook whose arguments are not the spec's
            raise PluginError(f"plugin {name!r}: {exc}") from exc
    try:
        manager.check_pending()  # a misspelt hook would otherwise be ignored: the plugin would provide nothing
    except pluggy.PluginValidationError as exc:
        hooks = ", ".join(sorted(KINDS.values()))
        raise PluginError(f"plugin {manager.get_name(exc.plugin)!r}: {exc}; the provider hooks are {hooks}") from exc
    registry = Registry(manager)
    for kind, hook_name in KINDS.items():
        registry.entries[kind] = _collect(manager, kind, hook_name)
    return registry


def _refuse_unmarked_hooks(manager: pluggy.PluginManager, plugin: str, module: object) -> None:
    """Pluggy registers only functions marked ``@hookimpl``: a provider hook without the mark would
    be skipped without a word, and the plugin would provide nothing."""
    for hook in KINDS.values():
        found = inspect.getattr_static(module, hook, None)  # static: never runs a module __getattr__
        if found is not None and manager.parse_hookimpl_opts(module, hook) is None:
            raise PluginError(f"plugin {plugin!r}: {hook} is not marked @hookimpl, so it would be ignored; "
                              "decorate it with @hookimpl (from arctic_core import hookimpl)")


def _load_entry_points() -> dict[str, object]:
    """Each ``arctic`` entry point's module by the entry point's name. Two packages claiming one
    name are refused: pluggy would keep the first and drop the other without a word (a package
    naming its plugin ``core`` would silently shadow Arctic's own)."""
    modules: dict[str, object] = {}
    seen: dict[str, importlib.metadata.EntryPoint] = {}
    for entry in installed_entry_points():
        if entry.name in seen:
            if seen[entry.name].value == entry.value:
                continue  # the same package found twice on the path
            both = " and ".join(sorted((_origin(seen[entry.name]), _origin(entry))))
            raise PluginConflictError(f"two packages name their '{ENTRY_POINT_GROUP}' entry point {entry.name!r}: "
                                      f"{both}; rename one")
        seen[entry.name] = entry
        try:
            modules[entry.name] = entry.load()
        except Exception as exc:
            raise PluginError(f"plugin {entry.name!r} ({_origin(entry)}) fails to import: "
                              f"{type(exc).__name__}: {exc}") from exc
    return modules


def _origin(entry: importlib.metadata.EntryPoint) -> str:
    package = entry.dist.name if entry.dist is not None else "an unknown package"
    return f"{entry.value} from {package}"


def _collect(manager: pluggy.PluginManager, kind: str, hook_name: str) -> dict[str, Provided]:
    out: dict[str, Provided] = {}
    for impl in getattr(manager.hook, hook_name).get_hookimpls():
        plugin = manager.get_name(impl.plugin) or repr(impl.plugin)
        try:
            provided = impl.function()
        except Exception as exc:
            raise PluginError(f"plugin {plugin!r}: its {hook_name} hook failed: {type(exc).__name__}: {exc}") from exc
        if provided is None:  # a hook with nothing to provide this time
            continue
        if not isinstance(provided, Mapping):
            raise PluginError(f"plugin {plugin!r}: {hook_name} must return a dict of name -> factory, "
                              f"got {type(provided).__name__}")
        for name, factory in provided.items():
            if name in out:
                raise PluginConflictError(
                    f"{kind} {name!r} is provided by both plugin {out[name].plugin!r} and {plugin!r}"
                )
            out[name] = Provided(kind, name, _checked_factory(factory, kind, name, plugin, hook_name), plugin)
    return out


def _checked_factory(factory: Any, kind: str, name: str, plugin: str, hook_name: str) -> Callable[..., Any]:
    """``factory`` if the server can call it (a lazy one told what it is registered as, for its
    errors); a string or other value would otherwise be listed and only fail when a config uses it."""
    if not (isinstance(name, str) and name.strip() == name and name):  # configs name products by these
        raise PluginError(f"plugin {plugin!r}: {hook_name} provides a product named {name!r}; a name is a "
                          "non-empty string without spaces at either end")
    if isinstance(factory, Lazy):
        return replace(factory, product=f"{kind.replace('_', ' ')} {name!r} of plugin {plugin!r}")
    if not callable(factory):
        raise PluginError(f"plugin {plugin!r}: {hook_name} provides {name!r} as a {type(factory).__name__}; a "
                          "factory must be callable, e.g. a class or Lazy('module:attribute', 'summary')")
    return factory


@functools.cache
def default_registry() -> Registry:
    """The registry of the installed plugins, built once per process."""
    return build_registry()


def installed_entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))

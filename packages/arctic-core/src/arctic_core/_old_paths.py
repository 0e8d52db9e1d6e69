"""Import paths of modules that moved, kept working.

Plugins written against arctic-core 0.1.0 import ``arctic_core.hookspecs`` and
``arctic_core.interfaces``, as that release documented; 0.2.0 grouped the core into subpackages.
Each old path below still imports: as a module that forwards every attribute to the module's new
home, so ``hookimpl`` and every class are the very same objects (a ``@hookimpl`` mark made through
the old path is the mark the registry looks for). The first import in a process warns once, with
a DeprecationWarning naming the new path, attributed to the line that imported the old one.

An old path is kept for at least one minor release after the one that moved it
(docs/design/plugin-system.md states the policy).

Another package keeps its own moved modules working the same way: its ``__init__`` calls
:func:`register_moved_modules` with its table (arctic-fca does, for its ``vllm_*`` modules).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

MOVED: dict[str, str] = {
    # 0.2.0: the core grouped by concept into plugins/, losses/, serving/, ray/ and weights/.
    "arctic_core.hookspecs": "arctic_core.plugins.hookspecs",
    "arctic_core.interfaces": "arctic_core.plugins.interfaces",
    "arctic_core.registry": "arctic_core.plugins.registry",
    "arctic_core.builtins": "arctic_core.plugins.builtins",
    "arctic_core.objective": "arctic_core.losses.objective",
    "arctic_core.processors": "arctic_core.losses.processors",
    "arctic_core.server": "arctic_core.serving.server",
    # (0.1.0's "arctic_core.wire" is no longer here: 0.3.0 moved the module back to that path.)
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
    # 0.3.0: the wire format sits beside the protocol; the client's transports speak it as much as the server.
    "arctic_core.serving.wire": "arctic_core.wire",
}
"""Old module path -> its current one (arctic-core's, and those other packages registered)."""

RENAMED: dict[str, dict[str, str]] = {
    # Renamed with the move: "InProcessTransport" was also the client's in-process transport.
    "arctic_core.weight_sync": {"InProcessTransport": "InProcessWeightSync"},
}
"""Old module path -> {old attribute name: its name in the new module}; only the old path has them."""


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Consulted after the regular finders, so a real module at an old path would win."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        # The origin shows in the module's repr: <module 'arctic_core.hookspecs' (moved to ...)>.
        return importlib.util.spec_from_loader(fullname, self, origin=f"moved to {MOVED[fullname]}")

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = importlib.import_module(MOVED[spec.name])
        # stacklevel 2 skips this frame; the import system's own frames are skipped by warnings itself.
        hint = ", or a plugin's names from arctic_core.plugins" if spec.name.startswith("arctic_core.") else ""
        warnings.warn(f"{spec.name} is deprecated: it moved to {new.__name__}; import from there{hint}",
                      DeprecationWarning, stacklevel=2)
        return _forwarding(spec.name, new, RENAMED.get(spec.name, {}))

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # nothing to run: every attribute comes from the new module


def _forwarding(name: str, new: types.ModuleType, renamed: dict[str, str]) -> types.ModuleType:
    module = types.ModuleType(name, new.__doc__)

    def __getattr__(attribute: str) -> object:  # read on each access, so it is never a stale copy
        return getattr(new, renamed.get(attribute, attribute))

    module.__getattr__ = __getattr__
    module.__dir__ = lambda: sorted({*dir(new), *renamed})
    # `from old import *` gives what it gave before the move: the module's public names.
    module.__all__ = [*getattr(new, "__all__", [n for n in vars(new) if not n.startswith("_")]), *renamed]
    return module


def install() -> None:
    if not any(isinstance(finder, _OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())


def register_moved_modules(table: dict[str, str]) -> None:
    """Keep another package's moved modules importable from their old paths (``table``: old path ->
    new one), as arctic-core's own: attributes that are the very objects of the new module, one
    DeprecationWarning per process at the importing line. Call it from the package's ``__init__``,
    which runs before any of its submodules is looked for. Registering the same table again is a
    no-op; an old path already sent elsewhere is refused."""
    for old, new in table.items():
        if MOVED.get(old, new) != new:
            raise ValueError(f"old module path {old!r} already moved to {MOVED[old]!r}, not {new!r}")
    MOVED.update(table)
    install()

"""The configuration reference, generated from the pydantic models themselves.

``arctic-rl config-reference`` prints it; ``docs/guides/configuration.md`` is its output for
Arctic's own plugins (``--builtin``), and a test keeps the two equal. Sections: every section of
:class:`ArcticConfig`, the sampling params of ``generate``, then the options of every backend, loss
term and weight transport the plugins register (each factory that declares an ``options_model``).
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Collection
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from arctic_core.config import ArcticConfig, SamplingParams
from arctic_core.errors import PluginError
from arctic_core.plugins.registry import Lazy, Provided, Registry

BUILTIN_PLUGINS = ("core", "zorro", "fca")
"""Arctic's own packages: the plugins the reference in the docs lists."""

HEADER = """# Configuration reference

Generated from the config models by `arctic-rl config-reference`; every key, its type, default
and meaning. A config is YAML (`arctic-rl serve --config FILE`) or a dict / `ArcticConfig` in
Python; unknown keys are refused with the valid ones listed. Only `model.path` is required. This
page lists Arctic's own plugins; the command also lists the options of the plugins installed
beside them.
"""

_BOUNDS = {annotated_types.Gt: ">", annotated_types.Ge: ">=", annotated_types.Lt: "<", annotated_types.Le: "<="}

PRODUCT_SECTIONS: dict[str, tuple[str, str]] = {
    "training_backend": ("Trainer backends", "in `trainer.options`"),
    "logprob_backend": ("Log-prob backends", "in `reference.options`"),
    "sampling_backend": ("Sampler backends", "in `sampler.options`"),
    "loss": ("Loss terms", "beside `name` and `weight` in a loss term"),
    "weight_transport": ("Weight transports", "in `weight_sync.options`"),
}
"""Each plugin kind whose products take options from a config: its section's title and where the
options go. Processors are absent: a processor takes only the request's temperature."""


def config_reference(registry: Registry, plugins: Collection[str] | None = None) -> str:
    """The reference, with the products of ``plugins`` that take options (None: every plugin)."""
    lines = [HEADER]
    for path, model in _sections("", ArcticConfig):
        lines += [f"## `{path}`" if path else "## Top level", "", *_doc(model), *_table(model), ""]
    lines += ["## Sampling params (`generate`)", "", *_table(SamplingParams), ""]
    for kind, (title, where) in PRODUCT_SECTIONS.items():
        lines += [f"## {title}", "", f"What each accepts {where}.", ""]
        for item in sorted(registry.all(), key=lambda p: p.name):
            if item.kind == kind and (plugins is None or item.plugin in plugins):
                lines += [f"### `{item.name}` ({item.plugin}): {item.summary}", "", *_product_options(item)]
    return "\n".join(lines).rstrip() + "\n"


def _product_options(item: Provided) -> list[str]:
    """The tables of one product's options. A plugin whose options model cannot be imported is
    marked instead, so one broken plugin does not hide every other plugin's options."""
    try:
        options = item.options_model()  # declared: no engine module imported to document it
        if options is None and isinstance(item.factory, Lazy):  # a lazy product that declares none
            options = getattr(item.factory.load(), "options_model", None)
    except PluginError as exc:
        return [f"**Options unavailable**: {exc}", ""]
    if options is None or not options.model_fields:
        return ["No options.", ""]
    lines = []
    for path, model in _sections("", options):  # nested option groups, e.g. `zorro`
        lines += [f"`{path}`:", ""] if path else []
        lines += [*_table(model), ""]
    return lines


def _sections(path: str, model: type[BaseModel]) -> list[tuple[str, type[BaseModel]]]:
    """``model`` and every model nested in its fields, depth first, with their dotted paths."""
    found = [(path, model)]
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        if nested is not None:
            found += _sections(f"{path}.{name}" if path else name, nested)
    return found


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def _doc(model: type[BaseModel]) -> list[str]:
    doc = (model.__doc__ or "").strip()
    return [" ".join(doc.split()), ""] if doc and not doc.startswith(("!!!", "Usage docs")) else []


def _table(model: type[BaseModel]) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        rows.append(f"| `{name}` | {_type(field)} | {_default(field)} | {_meaning(field)} |")
    return rows


def _type(field: FieldInfo) -> str:
    bounds = [f"{_BOUNDS[type(m)]} {getattr(m, next(iter(m.__dataclass_fields__)))}"
              for m in field.metadata if type(m) in _BOUNDS]
    text = _type_name(field.annotation)
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (list, tuple, dict):
        inner = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "see its section" if type(value).model_fields else "`{}`"
    return f"`{json.dumps(value, default=str)}`"


def _meaning(field: FieldInfo) -> str:
    return " ".join((field.description or "").split()).replace("|", "\\|")

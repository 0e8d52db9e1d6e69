"""Option parsing shared by the built-in loss terms."""

from __future__ import annotations

from typing import Any

from arctic_core.config import StrictModel, validate


def parse_options[M: StrictModel](model: type[M], term: str, options: dict[str, Any]) -> M:
    """Validate a term's options; the error names the term and each bad option."""
    return validate(model, options, f"options of loss {term!r}")

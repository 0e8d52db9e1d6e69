"""Start-up checks every adapter runs before its framework starts, so a bad run fails in seconds
with one line naming the problem and exit status 2, not a traceback from deep inside the framework."""

from __future__ import annotations

import os
import sys
import traceback
from importlib.metadata import version
from typing import NoReturn

from packaging.version import Version

from arctic_core.adapters.settings import BackendSettings
from arctic_core.client import ArcticClient
from arctic_core.config import ArcticConfig
from arctic_core.errors import ArcticError
from arctic_core.hf import max_positions
from arctic_core.model_folders import cached_model_folder
from arctic_core.plugins.checks import check_plugins
from arctic_core.plugins.registry import default_registry

CONNECT_TIMEOUT_S = 10.0


def _real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def check_server(settings: BackendSettings, model_path: str, model_key: str, reference_needed_by: str | None) -> None:
    """The server at ``settings.url`` answers, accepts the token, serves ``model_path`` (the
    framework's ``model_key``) and, when ``reference_needed_by`` names a setting, reference log-probs."""
    client = ArcticClient.http(settings.url, token=settings.token, timeout=CONNECT_TIMEOUT_S)
    try:
        served = client.status().info.get("config", {})
    finally:
        client.close()
    served_model = str(served.get("model", {}).get("path", ""))
    ours = {_real(path) for path in (model_path, cached_model_folder(model_path)) if path}  # a Hub id: its snapshot
    if served_model and _real(served_model) not in ours:
        raise ArcticError(f"the server at {settings.url} serves {served_model}, but {model_key} is {model_path}: "
                          "the framework's tokenizer and data must match the served model")
    if reference_needed_by and served.get("reference") is None:
        raise ArcticError(f"{reference_needed_by} needs reference log-probs, and the server at {settings.url} has no "
                          "reference model: start it with `reference: {}` in its config")


def check_backend(config: ArcticConfig) -> None:
    """The backend an adapter would start: its models are local folders (Hub models fetched here,
    where the backend finds them), and every plugin it names is installed and takes the options
    given (checked without importing any engine)."""
    config.with_local_models()
    check_plugins(config, default_registry())


def check_positions(model_path: str, tokens: int, what: str) -> None:
    """A sequence of ``tokens`` (the framework's prompt and response limits, named by ``what``) fits
    the positions of the model in the folder ``model_path``: past them every request would fail.
    Checked wherever that folder is here (a local folder, or a Hub model in the cache; whichever
    backend serves it); a missing one is the folder checks' to report."""
    from transformers import AutoConfig  # heavy; only where a folder is checked

    folder = cached_model_folder(model_path)
    if folder is None:
        return
    positions = max_positions(AutoConfig.from_pretrained(folder))
    if tokens > positions:
        raise ArcticError(f"{what} = {tokens} tokens, more than the model's max_position_embeddings={positions} "
                          f"({model_path}): lower them")


def describe(exc: BaseException, whose: str) -> str:
    """The message of a failed config check; a bare ``assert`` (no message) is named by its source
    line, as ``whose`` config check."""
    if str(exc):
        return str(exc)
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{whose} config check `{frame.line}` failed ({os.path.basename(frame.filename)}:{frame.lineno})"


def version_problem(adapter: str, distribution: str, minimum: str, below: str) -> str | None:
    """Why the installed ``distribution`` is outside ``>=minimum,<below`` (None when it is inside)."""
    found = Version(version(distribution))
    if Version(minimum) <= found < Version(below):
        return None
    return (f"{adapter} supports {distribution} >={minimum},<{below}; {distribution} {found} is installed "
            f"(pip install '{distribution}>={minimum},<{below}')")


def exit_with(adapter: str, problem: str) -> NoReturn:
    """End the process with one line on stderr and exit status 2."""
    print(f"{adapter}: error: {problem}", file=sys.stderr, flush=True)
    raise SystemExit(2)

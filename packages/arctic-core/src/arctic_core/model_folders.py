"""Where a model's files are: a local Hugging Face folder, or a Hub model fetched into the Hub's cache.

A model path is a folder in the ``save_pretrained`` layout, or a model id on the Hugging Face Hub
(``Qwen/Qwen3-1.7B``) that names no local path. A Hub model is fetched once into the Hub's cache
(``HF_HUB_CACHE``; ``HF_TOKEN`` for gated models, ``HF_HUB_OFFLINE=1`` to use the cache only), as
transformers and the RL frameworks do, and every engine then loads the cached snapshot: engines
are only ever handed local folders, so none of them downloads on its own.
"""

from __future__ import annotations

from pathlib import Path

from arctic_core.checkpoint_files import HF_EXPORT, STATE_FILE
from arctic_core.errors import ConfigError

# A causal LM's files: its configs, safetensors weights and tokenizer. Weights in other formats
# (pickled .bin) are fetched only for a model that has no safetensors.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
LEGACY_WEIGHTS = ["*.bin"]


def is_model_folder(path: str | Path) -> bool:
    return (Path(path).expanduser() / "config.json").is_file()


def hub_id(path: str) -> str | None:
    """``path`` as a Hub model id when it may be one: nothing exists at that path here, and it has the
    id's form (``name`` or ``org/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # only for Hub ids

    if Path(path).expanduser().exists():
        return None
    try:
        validate_repo_id(path)
    except HFValidationError:
        return None
    return path


def model_folder(path: str, setting: str, fetch: bool = True) -> str:
    """The local folder of the model at ``path`` (given as ``setting``): ``path`` itself when it is a
    model folder, the cached snapshot of a Hub model id (fetched first when not cached, unless not
    ``fetch``). Anything else is a :class:`ConfigError` naming ``setting``."""
    if is_model_folder(path):
        return path
    repo = hub_id(path)
    if repo is None:
        raise ConfigError(f"{setting}: {path!r} {_why_not_a_model(Path(path).expanduser())}; it must be a local "
                          "Hugging Face model folder (the "
                          "save_pretrained layout; `arctic-rl tiny-model DIR` writes a tiny one to try things with) "
                          "or a model id on the Hugging Face Hub")
    try:
        return _snapshot(repo, local_only=not fetch)
    except Exception as exc:  # offline, unknown or gated model, network: each named below
        raise ConfigError(f"{setting}: nothing is at {path!r} here, and fetching it as a model id from the "
                          f"Hugging Face Hub failed: {type(exc).__name__}: {_one_line(exc)}") from exc


def _why_not_a_model(folder: Path) -> str:
    if not folder.exists():
        return "does not exist"
    if (folder / STATE_FILE).is_file():  # a checkpoint of the trainer: its model folder is inside, if exported
        exported = folder / HF_EXPORT
        return ("is an Arctic checkpoint (load_checkpoint resumes from it); its model folder is "
                f"{str(exported)!r}" if is_model_folder(str(exported)) else
                "is an Arctic checkpoint saved without export_hf=True, so it holds no model folder "
                "(load_checkpoint resumes from it)")
    return "has no config.json"


def cached_model_folder(path: str) -> str | None:
    """The local folder of ``path`` without fetching anything: the folder itself, or a Hub model's
    snapshot already in the cache (None when neither is here)."""
    try:
        return model_folder(path, "model.path", fetch=False)
    except ConfigError:  # not here, or not cached
        return None


def _one_line(exc: Exception, limit: int = 400) -> str:
    """huggingface_hub's errors span several lines: the first ~400 characters, joined."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _snapshot(repo: str, local_only: bool = False) -> str:
    """The cached snapshot folder of the Hub model ``repo``, fetched unless ``local_only`` (with
    huggingface_hub's progress bars)."""
    from huggingface_hub import snapshot_download

    folder = snapshot_download(repo, allow_patterns=MODEL_FILES, local_files_only=local_only)
    if not any(Path(folder).glob("*.safetensors")):
        folder = snapshot_download(repo, allow_patterns=MODEL_FILES + LEGACY_WEIGHTS, local_files_only=local_only)
    if not is_model_folder(folder):
        raise FileNotFoundError(f"the Hub repository {repo!r} has no config.json (not a transformers model)")
    return folder

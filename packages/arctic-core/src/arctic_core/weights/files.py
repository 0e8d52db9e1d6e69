"""The ``safetensors-files`` weight transport: the trainer writes its weights as safetensors files
plus a JSON manifest; receivers (in this process or any other that sees the folder) load them.

Layout of the sync folder::

    manifest.json                  # {"format", "version", "files": [...], "aliases": {...}}
    v00000003-<id>/00000.safetensors ...

A version's files are written into a staging folder, renamed into place, and only then does the
manifest (itself written aside and renamed) point at them, so a reader that follows the manifest
never sees a half-written version. No pickle anywhere: tensors are safetensors, metadata is JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from arctic_core.config import StrictModel, WeightSyncConfig
from arctic_core.errors import ArcticError
from arctic_core.plugins.interfaces import TrainingBackend, WeightReceiver

MANIFEST = "manifest.json"
FORMAT = "arctic-weight-files/1"
KEEP_VERSIONS = 2  # the previous version stays readable for a reader that loaded the old manifest


class WeightFilesError(ArcticError, RuntimeError):
    """A weight-sync folder is missing, torn (a file is missing or truncated) or from another format."""


# --------------------------------------------------------------------------- writer side
def _view_key(tensor: torch.Tensor) -> tuple:
    """Identifies one exact view of one storage (tied embeddings yield the same key twice)."""
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def split_aliases(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | str]]:
    """Yields ``(name, tensor)``, or ``(name, earlier_name)`` for a tensor that is an exact alias.

    safetensors refuses tensors that share storage; tied weights are written once and re-named on load.
    """
    seen: dict[tuple, str] = {}
    for name, tensor in weights:
        key = _view_key(tensor)
        if key in seen:
            yield name, seen[key]
        else:
            seen[key] = name
            yield name, tensor


def _buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
             aliases: dict[str, str]) -> Iterator[dict[str, torch.Tensor]]:
    """Groups tensors into dicts of at most ``bucket_bytes`` (a larger tensor gets a file of its own)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    storages: set[int] = set()
    for name, item in split_aliases(weights):
        if isinstance(item, str):
            aliases[name] = item
            continue
        nbytes = item.numel() * item.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size, storages = {}, 0, set()
        tensor = item.detach().to("cpu").contiguous()
        # A different view of a storage already in this file (partial overlap) must be its own copy.
        ptr = tensor.untyped_storage().data_ptr()
        bucket[name] = tensor.clone() if ptr in storages else tensor
        storages.add(ptr)
        size += nbytes
    if bucket:
        yield bucket


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomically(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_weight_files(directory: Path, weights: Iterable[tuple[str, torch.Tensor]], version: int,
                       bucket_bytes: int) -> dict:
    """Writes one version into ``directory`` and publishes it through the manifest; returns the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    folder = f"v{version:08d}-{uuid.uuid4().hex[:8]}"  # unique, so a restarted counter never collides
    staging = directory / f".{folder}.tmp"
    staging.mkdir()
    files, aliases = [], {}
    for index, bucket in enumerate(_buckets(weights, bucket_bytes, aliases)):
        rel = f"{folder}/{index:05d}.safetensors"
        save_file(bucket, staging / f"{index:05d}.safetensors", metadata={"arctic_version": str(version)})
        files.append({"path": rel, "bytes": (staging / f"{index:05d}.safetensors").stat().st_size,
                      "tensors": list(bucket)})
    os.replace(staging, directory / folder)
    manifest = {"format": FORMAT, "version": version, "files": files, "aliases": aliases}
    _write_json_atomically(directory / MANIFEST, manifest)
    _prune(directory, current=folder)
    return manifest


def _prune(directory: Path, current: str) -> None:
    """Drops all but the newest ``KEEP_VERSIONS`` version folders (and stale staging folders)."""
    # Ordered by time, not by name: a restarted server counts versions from 1 again.
    versions = sorted((p for p in directory.glob("v*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    stale = [p for p in versions[:-KEEP_VERSIONS] if p.name != current]
    stale += [p for p in directory.glob(".v*.tmp") if p.is_dir()]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- reader side
def read_manifest(directory: str | Path) -> dict:
    """The published manifest, checked: every file it names exists with the size it recorded."""
    directory = Path(directory)
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightFilesError(f"no weights published in {directory} (no {MANIFEST})") from None
    except json.JSONDecodeError as exc:
        raise WeightFilesError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise WeightFilesError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    for entry in manifest["files"]:
        file = directory / entry["path"]
        if not file.is_file():
            raise WeightFilesError(f"torn weight sync: version {manifest['version']} names {entry['path']}, "
                                   f"which is missing from {directory}")
        if file.stat().st_size != entry["bytes"]:
            raise WeightFilesError(f"torn weight sync: {entry['path']} has {file.stat().st_size} bytes, "
                                   f"the manifest says {entry['bytes']}")
    return manifest


def _iter_tensors(directory: Path, manifest: dict, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    by_name: dict[str, torch.Tensor] = {}
    wanted = set(manifest["aliases"].values())
    for entry in manifest["files"]:
        with safe_open(directory / entry["path"], framework="pt", device=device) as f:
            written = (f.metadata() or {}).get("arctic_version")
            if written != str(manifest["version"]):
                raise WeightFilesError(f"{entry['path']} holds version {written}, the manifest says "
                                       f"{manifest['version']}")
            for name in entry["tensors"]:
                tensor = f.get_tensor(name)
                if name in wanted:  # keep only what a tied alias will need again
                    by_name[name] = tensor
                yield name, tensor
    for alias, target in manifest["aliases"].items():
        yield alias, by_name[target]


def load_weight_files(directory: str | Path, device: str = "cpu") -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """Receiver side, usable from any process: ``(version, iterator of (name, tensor))``.

    The manifest and every file it names are checked before anything is returned, so a torn
    version is refused before a receiver has copied a single tensor.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    return int(manifest["version"]), _iter_tensors(directory, manifest, device)


# --------------------------------------------------------------------------- the transport
class FilesOptions(StrictModel):
    dir: str | None = None
    """Where the files are written (a folder every receiver can read); None: a temporary folder."""


class SafetensorsFilesTransport:
    """Trainer -> safetensors files in ``options.dir`` (default: a temp folder per server) -> receivers."""

    options_model = FilesOptions

    def __init__(self, config: WeightSyncConfig | None = None) -> None:
        self.config = config or WeightSyncConfig()
        options = self.config.checked_options(self.options_model)
        if options.dir is not None:
            self.dir = Path(options.dir)
        else:
            self.dir = Path(tempfile.mkdtemp(prefix="arctic-weights-"))
            weakref.finalize(self, shutil.rmtree, self.dir, True)  # ours, so ours to remove

    def sync(self, source: TrainingBackend, receivers: list[WeightReceiver], version: int) -> dict[str, float]:
        start = time.perf_counter()
        manifest = write_weight_files(self.dir, source.named_weights(), version, self.config.bucket_bytes)
        written = time.perf_counter()
        for receiver in receivers:
            loaded_version, weights = load_weight_files(self.dir)
            if loaded_version != version:
                raise WeightFilesError(f"{self.dir} holds version {loaded_version} after writing {version}: "
                                       "another writer shares this folder")
            receiver.update_weights(weights, loaded_version)
        end = time.perf_counter()
        return {
            "seconds": end - start,
            "write_seconds": written - start,
            "bytes": float(sum(f["bytes"] for f in manifest["files"])),
            "files": float(len(manifest["files"])),
            "receivers": float(len(receivers)),
        }

"""Checkpoint folders on disk: written beside their target and moved into place, so that a process
killed at any moment leaves either the previous checkpoint or the new one at the path, never a
mixture, and nothing half-written is ever loaded.

A save writes ``.{name}.tmp-{pid}`` (staging), then replaces the target with two renames: the old
checkpoint to ``.{name}.old-{pid}``, the staging folder to the target. A process killed between
the two leaves the target missing and its old copy complete; :func:`recover` moves it back. The
next save removes what dead processes left behind.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from arctic_core.checkpoint_files import HF_EXPORT, STATE_FILE  # noqa: F401 (importable from here too, as before)
from arctic_core.config import format_validation_error
from arctic_core.errors import RequestError

log = logging.getLogger(__name__)


class CheckpointState(BaseModel):
    """The server's counters, in :data:`STATE_FILE`."""

    step: int = Field(ge=0)
    policy_version: int = Field(ge=0)


def checkpoint_path(path: str) -> Path:
    """``path`` as a checkpoint folder of the server's file system (``~`` its user's home, a relative
    path from its working directory); refused unless it names one (not empty, ``.``, ``..`` or ``/``)."""
    if "\0" in path:
        raise RequestError(f"checkpoint path {path!r} contains a NUL byte")
    folder = Path(path).expanduser()
    if folder.name in ("", ".."):
        raise RequestError(f"checkpoint path {path!r} does not name a folder; give e.g. 'checkpoints/step-100'")
    return folder


def read_checkpoint(folder: Path) -> CheckpointState:
    """The state of the complete checkpoint in ``folder`` (put back first if a save died while
    replacing it), checked before anything is loaded from it."""
    recover(folder)
    if not (folder / STATE_FILE).is_file():
        raise RequestError(f"{folder} is not an Arctic checkpoint (no {STATE_FILE})")
    return read_state(folder)


def read_state(folder: Path) -> CheckpointState:
    """``folder``'s :data:`STATE_FILE`, validated; a RequestError names the file and what is wrong."""
    file = folder / STATE_FILE
    try:
        return CheckpointState.model_validate_json(file.read_bytes())
    except OSError as exc:
        raise RequestError(f"cannot read {file}: {exc}") from exc
    except ValidationError as exc:
        raise RequestError(format_validation_error(exc, f"checkpoint state {file}")) from None


def staging_for(target: Path) -> Path:
    """The folder a save of ``target`` writes into (after clearing what dead saves left). Only an
    Arctic checkpoint or an empty folder may be replaced: anything else at ``target`` is refused."""
    recover(target)
    _check_replaceable(target)
    _remove_stale(target)
    return _sibling(target, "tmp", os.getpid())


def _check_replaceable(target: Path) -> None:
    # A save replaces the whole folder: never take a user's files with it.
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise RequestError(f"cannot save a checkpoint at {target}: it exists and is not a folder")
    if target.is_dir() and not (target / STATE_FILE).is_file() and any(target.iterdir()):
        raise RequestError(f"cannot save a checkpoint at {target}: the folder is not empty and not an Arctic "
                           f"checkpoint (no {STATE_FILE}); choose a new or empty folder")


def publish(staging: Path, target: Path) -> None:
    """Move ``staging`` to ``target``, replacing an existing checkpoint with two renames."""
    old = _sibling(target, "old", os.getpid())
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


def recover(target: Path) -> None:
    """Put back the previous checkpoint when a save died between its two renames (``target``
    gone, its old copy complete). A staging folder is never taken: it may be half-written."""
    if target.exists():
        return
    complete = [old for old in _siblings(target, "old") if (old / STATE_FILE).is_file()]
    if complete:
        log.warning("restoring %s from %s: a save was interrupted while replacing it", target, complete[-1])
        os.replace(complete[-1], target)


def prune(saved: Path, keep: int) -> None:
    """Keep ``saved``, the checkpoint just written, and the ``keep - 1`` newest other complete
    checkpoints beside it (by step, then save time); delete the older ones. ``saved`` counts as the
    newest even when its step is lower (a save after loading an earlier checkpoint). Other folders,
    and checkpoints whose state cannot be read, are left alone."""
    ranked = []
    for folder in saved.parent.iterdir():
        if folder.name != saved.name and (rank := _rank(folder)) is not None:
            ranked.append((rank, folder))
    ranked.sort()
    for _, old in ranked[:max(len(ranked) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def _rank(folder: Path) -> tuple[int, float] | None:
    """(step, save time) of the complete checkpoint in ``folder``; None if it is not one."""
    state_file = folder / STATE_FILE
    try:
        if folder.name.startswith(".") or folder.is_symlink() or not state_file.is_file():
            return None
        return read_state(folder).step, state_file.stat().st_mtime
    except (OSError, RequestError) as exc:
        log.warning("keep_last leaves %s alone: %s", folder, exc)
        return None


def _remove_stale(target: Path) -> None:
    """Staging folders of dead processes, and old copies once ``target`` itself is complete."""
    for folder in _siblings(target, "tmp"):
        if not _process_alive(int(folder.name.rsplit("-", 1)[1])):
            shutil.rmtree(folder, ignore_errors=True)
    if (target / STATE_FILE).is_file():
        for folder in _siblings(target, "old"):
            shutil.rmtree(folder, ignore_errors=True)


def _sibling(target: Path, kind: str, pid: int) -> Path:
    """A hidden folder beside ``target``: ``tmp`` (being written) or ``old`` (being replaced)."""
    return target.with_name(f".{target.name}.{kind}-{pid}")


def _siblings(target: Path, kind: str) -> list[Path]:
    if not target.parent.is_dir():
        return []
    # Only names this module writes (a process id after the dash): a user's look-alike folder is left alone.
    found = target.parent.glob(f".{glob.escape(target.name)}.{kind}-*")
    return sorted(folder for folder in found if folder.name.rsplit("-", 1)[1].isdigit())


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True

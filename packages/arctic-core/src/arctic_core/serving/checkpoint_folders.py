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
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

STATE_FILE = "arctic_state.json"
"""Written last into every checkpoint folder: its presence marks a complete checkpoint."""


def staging_for(target: Path) -> Path:
    """The folder a save of ``target`` writes into (after clearing what dead saves left)."""
    _remove_stale(target)
    return _sibling(target, "tmp", os.getpid())


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


def prune(folder: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints in ``folder`` (other folders untouched)."""
    found = [d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".") and (d / STATE_FILE).is_file()]
    found.sort(key=lambda d: (json.loads((d / STATE_FILE).read_text())["step"], d.stat().st_mtime))
    for old in found[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale(target: Path) -> None:
    """Staging folders of dead processes, and old copies once ``target`` itself is complete."""
    recover(target)
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
    return sorted(target.parent.glob(f".{glob.escape(target.name)}.{kind}-*"))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True

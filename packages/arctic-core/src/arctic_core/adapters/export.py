"""The policy's Hugging Face export, placed where a framework expects its model folder.

A checkpoint saved with ``export_hf=True`` holds the policy as a Hugging Face model folder in its
:data:`~arctic_core.checkpoint_files.HF_EXPORT` subfolder. Frameworks look for that model
elsewhere: verl in ``<checkpoint>/huggingface``, TRL in the output folder itself, SkyRL in an
export folder of its own. These functions put it there without a second copy of the weights where
a link will do. (With a backend on another machine the export is written there: nothing is
placed here.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from arctic_core.checkpoint_files import HF_EXPORT
from arctic_core.client import ArcticClient


def link_export(checkpoint: str | os.PathLike, link: str | os.PathLike) -> None:
    """``link`` (inside the checkpoint) names the checkpoint's export folder (a relative link: the
    checkpoint can move)."""
    checkpoint, link = Path(checkpoint), Path(link)
    if (checkpoint / HF_EXPORT).is_dir():
        link.symlink_to(os.path.relpath(checkpoint / HF_EXPORT, link.parent), target_is_directory=True)


def link_export_files(checkpoint: str | os.PathLike, folder: str | os.PathLike) -> None:
    """Each file of the checkpoint's export, linked into ``folder`` (which holds the checkpoint),
    so that ``from_pretrained(folder)`` reads the exported model."""
    checkpoint, folder = Path(checkpoint), Path(folder)
    export = checkpoint / HF_EXPORT
    if not export.is_dir():
        return
    for file in export.iterdir():
        link = folder / file.name
        link.unlink(missing_ok=True)
        link.symlink_to(file.relative_to(folder))


def export_model(client: ArcticClient, export_dir: str | os.PathLike) -> None:
    """The policy as a Hugging Face folder at ``export_dir`` (replacing what is there): saved into
    a scratch checkpoint beside it, whose export is then moved into place (a rename)."""
    export_dir = os.path.abspath(export_dir)
    parent = os.path.dirname(export_dir)
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent) as scratch:
        checkpoint = os.path.join(scratch, "checkpoint")
        client.save_checkpoint(checkpoint, export_hf=True)
        shutil.rmtree(export_dir, ignore_errors=True)
        shutil.move(os.path.join(checkpoint, HF_EXPORT), export_dir)

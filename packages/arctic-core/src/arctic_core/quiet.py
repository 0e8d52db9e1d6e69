"""Start-up banners of other libraries that every CPU run prints and no user acts on, hidden.

``ARCTIC_RL_VERBOSE=1`` (``arctic-rl --verbose`` sets it, for its own process and those it starts)
keeps them. Only these exact lines go: every other warning of those libraries is still shown.
"""

from __future__ import annotations

import logging
import os

VERBOSE_ENV = "ARCTIC_RL_VERBOSE"

# (logger, start of the message). Each says a GPU was not found, on runs that asked for the CPU.
BANNERS = (
    # DeepSpeed guesses its accelerator when DS_ACCELERATOR is unset; accelerate imports DeepSpeed
    # whenever it is installed (a save_pretrained is enough), before any engine could set it.
    ("DeepSpeed", "Setting accelerator to CPU"),
    # torch's extension builder, imported by DeepSpeed's op builders, looks for a CUDA toolkit.
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
)


class DropBanner(logging.Filter):
    """Drops a logger's records whose message starts with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def hide_banners() -> None:
    """Filter :data:`BANNERS` out of their loggers (once; a no-op when verbose).

    A filter on the logger itself, not a level: DeepSpeed sets its logger's level when it is
    imported, which would undo one set before, while filters stay."""
    if verbose():
        return
    for name, start in BANNERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropBanner) and f.start == start for f in logger.filters):
            logger.addFilter(DropBanner(start))

"""``torch.compile`` for the small functions that fuse elementwise work (processors, norms,
activations): each compiled once per process with dynamic shapes, so any token count reuses it."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` compiled by ``torch.compile`` (dynamic shapes), the same object on every call."""
    return torch.compile(fn, dynamic=True)

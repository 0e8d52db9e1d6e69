"""Kernels compiled or planned once for many shapes: ``torch.compile`` for the small functions that
fuse elementwise work (processors, norms, activations), each compiled once per process with dynamic
shapes, and the padded lengths that keep per-shape kernels (fixed-shape FlexAttention, cuDNN's
attention plans) to a handful of shapes."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` compiled by ``torch.compile`` (dynamic shapes), the same object on every call."""
    return torch.compile(fn, dynamic=True)


def bucketed_length(tokens: int, granule: int) -> int:
    """``tokens`` rounded up to one of 8 lengths per octave, each a multiple of ``granule``: a run
    whose lengths keep changing meets a few shapes, for at most 1/8 more tokens (or one granule)."""
    step = max(granule, 1 << max(tokens.bit_length() - 4, 0))
    return -(-tokens // step) * step

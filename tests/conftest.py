"""Process settings of the main test suite. Its fixtures (``tiny_policy``, ``arctic_config``,
``hub_cache``) are shared with every suite: see :mod:`arctic_core.testing`."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # Ray workers use this checkout, nothing uploaded
torch.set_num_threads(min(2, torch.get_num_threads()))

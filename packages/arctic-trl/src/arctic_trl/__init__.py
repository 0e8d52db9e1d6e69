"""TRL on the Arctic backend: replace ``from trl import GRPOTrainer`` with
``from arctic_trl import GRPOTrainer``; nothing else in the script changes.

Supported: trl 1.16.x (the adapter overrides TRL internals that change between minor releases).
"""

from importlib.metadata import version

from packaging.version import Version

SUPPORTED_TRL = (Version("1.16"), Version("1.17"))
_found = Version(version("trl"))
if not SUPPORTED_TRL[0] <= _found < SUPPORTED_TRL[1]:
    raise ImportError(f"arctic_trl supports trl >=1.16,<1.17; trl {_found} is installed")

from arctic_core.quiet import hide_banners  # noqa: E402

hide_banners()  # a TRL script's terminal shows its own progress, not DeepSpeed's missing-GPU notices

from arctic_trl.trainer import ArcticOptimizer, GRPOTrainer, PolicyStub  # noqa: E402

__all__ = ["ArcticOptimizer", "GRPOTrainer", "PolicyStub"]

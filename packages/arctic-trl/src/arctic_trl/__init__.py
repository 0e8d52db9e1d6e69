"""TRL on the Arctic backend: replace ``from trl import GRPOTrainer`` with
``from arctic_trl import GRPOTrainer``; nothing else in the script changes.

Supported: trl 1.16.x (the adapter overrides TRL internals that change between minor releases).
"""

from arctic_core.adapters.mapping import framework_version_problem
from arctic_trl.mapping import MAPPING

_problem = framework_version_problem(MAPPING)
if _problem:
    raise ImportError(_problem)

from arctic_core.quiet import hide_banners  # noqa: E402

hide_banners()  # a TRL script's terminal shows its own progress, not DeepSpeed's missing-GPU notices

from arctic_trl.trainer import ArcticOptimizer, GRPOTrainer, PolicyStub  # noqa: E402

__all__ = ["ArcticOptimizer", "GRPOTrainer", "PolicyStub"]

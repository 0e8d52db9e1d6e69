"""SkyRL's PPO/GRPO trainer on the Arctic backend.

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=arctic_skyrl.entrypoint ...
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("arctic-skyrl")  # the pyproject's, never a second copy to keep in step
except PackageNotFoundError:  # imported from a source tree without being installed
    __version__ = "0+unknown"

"""SkyRL's PPO/GRPO trainer on the Arctic backend.

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=arctic_skyrl.entrypoint ...
"""

__version__ = "0.1.0"

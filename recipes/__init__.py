"""Arctic RL recipes: data preparation, rewards and launch scripts per task (run from the
repository root, e.g. ``python -m recipes.gsm8k.prepare_data``)."""

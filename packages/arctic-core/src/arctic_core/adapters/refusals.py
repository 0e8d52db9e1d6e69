"""The reasons adapters give, in the same words everywhere, when they refuse a framework's setting."""

FULL_WEIGHTS = "Arctic trains full weights (no LoRA)"
NO_CRITIC = "a critic (value model) is not served by Arctic; use a critic-free estimator"
TEXT_ONLY = "Arctic samples text only"
STOP_STRINGS = "Arctic's samplers stop on tokens, not strings"
ADAMW_ONLY = "Arctic's backends step torch's AdamW"


def model_config_changes(model_key: str) -> str:
    """Why a framework's in-memory changes to the model's config are refused."""
    return f"Arctic builds the model from the config.json in {model_key}; put the changes there"


def own_workers(feature: str) -> str:
    """Why a framework setting that drives the framework's own GPU workers is refused."""
    return f"{feature} drives the framework's own GPU workers, which do not run here"

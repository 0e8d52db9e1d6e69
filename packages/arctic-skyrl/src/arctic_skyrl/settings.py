"""The ``arctic`` section the adapter adds to SkyRL's config.

SkyRL's config is a strict dataclass tree (unknown keys are refused), so the adapter's entry point
parses the command line with :class:`ArcticSkyRLConfig`, SkyRL's root config plus this section:
``arctic.url=http://127.0.0.1:8000``, ``arctic.config.trainer.options.zero_stage=3``, ...
The keys mean what :class:`~arctic_core.adapters.settings.BackendSettings` documents.
"""

# No `from __future__ import annotations`: SkyRL builds its config from the field types.
from dataclasses import asdict, dataclass, field, fields

from omegaconf import DictConfig
from skyrl.train.config.config import BaseConfig, SkyRLTrainConfig

from arctic_core.adapters.settings import BackendSettings, settings_dataclass
from arctic_core.config import unknown_key, validate
from arctic_core.errors import ConfigError

# Where the backend runs (the keys and defaults of BackendSettings, which validates them).
ArcticSection = settings_dataclass(BackendSettings, "ArcticSection", __name__, (BaseConfig,))


@dataclass
class ArcticSkyRLConfig(SkyRLTrainConfig):
    """SkyRL's root config with the ``arctic`` section."""

    arctic: ArcticSection = field(default_factory=ArcticSection)

    @classmethod
    def from_dict_config(cls, cfg: DictConfig) -> "ArcticSkyRLConfig":
        """SkyRL's build of the parsed command line, after a check of the ``arctic`` keys: SkyRL's
        own refusal of a misspelt one ("Invalid fields {'urll'} for ArcticSection") suggests none."""
        arctic = cfg.get("arctic")
        if isinstance(arctic, DictConfig):
            valid = [f.name for f in fields(ArcticSection)]
            for key in arctic:
                if key not in valid:
                    raise ConfigError(f"arctic.{key}: {unknown_key(str(key), valid, ' in the arctic section')}")
        return super().from_dict_config(cfg)


def read_settings(cfg: ArcticSkyRLConfig) -> BackendSettings:
    """The ``arctic`` section, validated (bad values name their key)."""
    return validate(BackendSettings, asdict(cfg.arctic), "'arctic' section of the SkyRL config", prefix="arctic.")

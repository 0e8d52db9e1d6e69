"""The ``arctic`` section the adapter adds to SkyRL's config.

SkyRL's config is a strict dataclass tree (unknown keys are refused), so the adapter's entry point
parses the command line with :class:`ArcticSkyRLConfig`, SkyRL's root config plus this section:
``arctic.url=http://127.0.0.1:8000``, ``arctic.config.trainer.options.zero_stage=3``, ...
The keys mean what :class:`~arctic_core.adapters.settings.BackendSettings` documents.
"""

# No `from __future__ import annotations`: SkyRL builds its config from the field types.
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Optional

from omegaconf import DictConfig
from skyrl.train.config.config import BaseConfig, SkyRLTrainConfig

from arctic_core.adapters.settings import BackendSettings
from arctic_core.config import unknown_key, validate
from arctic_core.errors import ConfigError


@dataclass
class ArcticSection(BaseConfig):
    """Where the backend runs (see :class:`~arctic_core.adapters.settings.BackendSettings`)."""

    url: Optional[str] = None  # noqa: UP045 (SkyRL's config parser reads typing annotations)
    token: Optional[str] = None  # noqa: UP045
    config: Dict[str, Any] = field(default_factory=dict)  # noqa: UP006
    timeout: float = 600.0
    group_quiet_ms: float = 200.0
    group_max_wait_ms: float = 5000.0


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

"""Config models: defaults that run, YAML loading, and readable validation errors."""

from __future__ import annotations

import pytest

from arctic_core.config import ArcticConfig, SamplingParams, SchedulerConfig
from arctic_core.errors import ConfigError


def test_defaults_fill_everything_but_the_model():
    config = ArcticConfig.from_dict({"model": {"path": "/m"}})
    assert config.trainer.backend == "deepspeed" and config.sampler.backend == "embedded"
    assert config.trainer.optimizer.max_grad_norm == 1.0 and config.reference is None


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "arctic.yaml"
    path.write_text(
        "model: {path: /m, dtype: bfloat16}\n"
        "trainer:\n  optimizer: {lr: 2.0e-6}\n  scheduler: {name: cosine, warmup_steps: 10, total_steps: 100}\n"
        "reference: {}\n"
    )
    config = ArcticConfig.from_yaml(path)
    assert config.model.dtype == "bfloat16" and config.trainer.optimizer.lr == 2e-6
    assert config.trainer.scheduler.name == "cosine" and config.reference is not None


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({}, "model: Field required"),
        ({"model": {"path": "/m"}, "trainer": {"optimiser": {}}}, "trainer.optimiser: Extra inputs are not permitted"),
        ({"model": {"path": "/m", "dtype": "fp8"}}, "model.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
        ({"model": {"path": "/m"}, "trainer": {"optimizer": {"lr": -1}}}, "trainer.optimizer.lr: Input should be greater than 0"),
        ({"model": {"path": "/m"}, "trainer": {"scheduler": {"name": "linear"}}}, "needs total_steps"),
    ],
)
def test_validation_errors_name_the_field(data, expected):
    with pytest.raises(ConfigError) as info:
        ArcticConfig.from_dict(data)
    assert expected in str(info.value)
    assert str(info.value).startswith("invalid ArcticConfig:")


def test_bad_yaml_file_is_reported_with_its_path(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read config .*broken.yaml"):
        ArcticConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="cannot read config"):
        ArcticConfig.from_yaml(tmp_path / "missing.yaml")


def test_scheduler_and_sampling_params_bounds():
    assert SchedulerConfig(name="constant").total_steps is None
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    assert SamplingParams(temperature=0).greedy

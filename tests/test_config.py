"""Config models: defaults that run, YAML loading, and readable validation errors."""

from __future__ import annotations

import re

import pytest

from arctic_core.config import ArcticConfig, LossTermConfig, SamplingParams, SchedulerConfig, validate
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
        ({"model": {"path": "/m"}, "trainer": {"optimiser": {}}},
         "trainer.optimiser: unknown key (did you mean 'optimizer'?); valid keys: backend, checkpoint_layers,"),
        ({"model": {"path": "/m"}, "trainer": {"optimizer": {"betas": [0.9, 0.99], "epss": 1e-8}}},
         "trainer.optimizer.epss: unknown key (did you mean 'eps'?); valid keys: betas, decay, eps, lr, max_grad_norm, "
         "weight_decay"),
        ({"model": {"path": "/m"}, "reference": {"modle": {}}}, "reference.modle: unknown key (did you mean 'model'?)"),
        ({"model": {"path": "/m", "dtype": "fp8"}}, "model.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
        ({"model": {"path": "/m"}, "trainer": {"optimizer": {"lr": -1}}},
         "trainer.optimizer.lr: Input should be greater than 0"),
        ({"model": {"path": "/m"}, "trainer": {"scheduler": {"name": "linear"}}}, "needs total_steps"),
        ({"model": {"path": "/m", "device": "gpu"}}, "model.device: String should match pattern"),
        ({"model": {"path": "/m"}, "trainer": {"optimizer": {"betas": [0.9, 1.5]}}},
         "trainer.optimizer.betas.1: Input should be less than 1"),
        ({"model": {"path": "/m"}, "seed": 2**70}, "seed: Input should be less than 9223372036854775808"),
        ({"model": {"path": "/m"}, "trainer": {"optimizer": {"lr": float("inf")}}},
         "trainer.optimizer.lr: Input should be a finite number"),
        ({"model": {"path": "/m"}, "trainer": {"optimizer": {"lr": float("nan")}}},
         "trainer.optimizer.lr: Input should be a finite number"),
        # A value that fits none of a field's types: one line, without pydantic's tags of the types.
        ({"model": {"path": "/m"}, "trainer": {"checkpoint_layers": "all"}},
         "invalid ArcticConfig:\n  trainer.checkpoint_layers: Input should be a valid integer, unable to parse "
         "string as an integer or Input should be 'auto'"),
    ],
)
def test_validation_errors_name_the_field(data, expected):
    with pytest.raises(ConfigError) as info:
        ArcticConfig.from_dict(data)
    assert expected in str(info.value)
    assert str(info.value).startswith("invalid ArcticConfig:")


def test_backend_options_are_checked_by_the_backend_with_their_full_path():
    from arctic_core.config import StrictModel, TrainerConfig, validate_options

    class Options(StrictModel):
        zero_stage: int = 2
        offload: bool = False

    trainer = TrainerConfig(options={"zero_stag": 3})
    with pytest.raises(ConfigError) as info:
        validate_options(Options, trainer, "deepspeed")
    assert str(info.value) == ("invalid trainer.options of backend 'deepspeed':\n  trainer.options.zero_stag: unknown "
                               "key (did you mean 'zero_stage'?); valid keys: offload, zero_stage")
    assert validate_options(Options, TrainerConfig(options={"offload": True}), "deepspeed").offload


def test_model_folders_are_checked_before_any_engine_starts(tmp_path, tiny_policy):
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy)},
                                     "reference": {"model": {"path": str(tmp_path)}}})
    with pytest.raises(ConfigError, match="reference.model.path: .* has no config.json"):
        config.with_local_models()


def test_bad_yaml_file_is_reported_with_its_path(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read config .*broken.yaml"):
        ArcticConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="cannot read config"):
        ArcticConfig.from_yaml(tmp_path / "missing.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"model:\n  path: \xff\xfe\n")
    with pytest.raises(ConfigError, match="cannot read config .*binary.yaml: 'utf-8' codec can't decode"):
        ArcticConfig.from_yaml(binary)


def test_scheduler_and_sampling_params_bounds():
    assert SchedulerConfig(name="constant").total_steps is None
    assert ArcticConfig.from_dict({"model": {"path": "/m", "device": "cuda:1"}}).model.device == "cuda:1"
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)  # torch's generators take 64-bit seeds
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[2**63])
    with pytest.raises(ValueError, match="weight"):
        LossTermConfig(name="ppo", weight=float("nan"))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    assert SamplingParams(temperature=0).greedy
    # Logits divided by a tinier temperature or penalty overflow: refused, naming the field.
    for params, message in (({"temperature": 1e-45}, "temperature: Value error, 1e-45 is below 0.01: use 0 for greedy"),
                            ({"temperature": float("inf")}, "temperature: Input should be a finite number"),
                            ({"repetition_penalty": 1e-40}, "repetition_penalty: Input should be greater than or equal "
                                                            "to 0.01"),
                            ({"repetition_penalty": float("inf")}, "repetition_penalty: Input should be a finite")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(SamplingParams, params)
    assert SamplingParams(temperature=0.01, repetition_penalty=1e3).temperature == 0.01


def test_an_option_of_a_backend_that_takes_none_is_refused_as_such():
    from arctic_core.config import StrictModel, TrainerConfig, validate_options

    class NoOptions(StrictModel):
        pass

    with pytest.raises(ConfigError, match=r"trainer.options.speed: unknown key; this takes no options$"):
        validate_options(NoOptions, TrainerConfig(options={"speed": 1}), "plain")

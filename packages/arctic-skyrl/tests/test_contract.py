"""The SkyRL interfaces arctic-skyrl stands in for: every method SkyRL calls is implemented.

The calls are read from SkyRL's own source, so a SkyRL release whose trainer calls a dispatch
method arctic-skyrl lacks fails here, not in a user's run.
"""

from __future__ import annotations

import asyncio
import inspect
import re

import skyrl.train.trainer as skyrl_trainer
from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInterface

from arctic_core.adapters.settings import BackendSettings
from arctic_skyrl.dispatch import ArcticDispatch
from arctic_skyrl.inference import ArcticInferenceClient


def test_every_dispatch_method_skyrl_trainer_calls_is_implemented():
    called = set(re.findall(r"self\.dispatch\.(\w+)\(", inspect.getsource(skyrl_trainer)))
    assert {"forward_backward_from_staged", "optim_step", "save_weights_for_sampler"} <= called  # the pattern reads
    missing = sorted(name for name in called if name not in vars(ArcticDispatch))
    assert not missing, f"SkyRL's trainer calls dispatch methods arctic-skyrl lacks: {missing}"


def test_the_inference_client_implements_skyrl_interface():
    abstract = {name for name, value in vars(InferenceEngineInterface).items()
                if getattr(value, "__isabstractmethod__", False)}
    assert abstract <= set(vars(ArcticInferenceClient)), sorted(abstract - set(vars(ArcticInferenceClient)))
    client = ArcticInferenceClient(lambda: None, tokenizer=None, model_path="m", default_sampling={},
                                   settings=BackendSettings())
    assert asyncio.run(client.get_world_size()) == (1, 1)

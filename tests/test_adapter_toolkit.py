"""arctic_core.adapters: the pieces every framework adapter builds on, each against the plain
computation (the adapters' own suites check each framework through them end to end)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR, LinearLR, SequentialLR

from arctic_core.adapters.backend import BackendAddress, async_connect, open_backend
from arctic_core.adapters.export import export_model, link_export, link_export_files
from arctic_core.adapters.mapping import (BackendInputs, backend_config, check_supported, framework_version_problem,
                                          placement)
from arctic_core.adapters.metrics import framework_metrics, mean_over_calls, prefixed
from arctic_core.adapters.sampling import GroupedSampler, end_of_sequence_ids
from arctic_core.adapters.schedule import StandInSchedule
from arctic_core.adapters.settings import BackendSettings, settings_dataclass
from arctic_core.checkpoint_files import HF_EXPORT, STATE_FILE
from arctic_core.client import ArcticClient, AsyncArcticClient
from arctic_core.config import ArcticConfig, SamplingParams
from arctic_core.errors import ConfigError
from arctic_core.serving.http import create_app
from arctic_core.serving.server import ArcticServer


class Mapping:
    """A framework whose config is a dict: ``refuse`` lists refused keys, ``lr`` the learning rate."""

    adapter, framework, supported = "arctic-test", "pytest", ("8.0", "99")  # pytest runs this: it is installed
    owner = "the test's own config"
    metric_names = {"pg_loss": "{policy}/loss", "entropy": "-entropy/loss", "kl": "kl/loss"}

    @staticmethod
    def refusals(config: dict, settings: BackendSettings) -> list[str]:
        return [f"{key}={config[key]!r}: not here" for key in config.get("refuse", [])]

    @staticmethod
    def loss_terms(config: dict) -> list[dict]:
        return [{"name": "pg"}]

    @staticmethod
    def backend_inputs(config: dict, on_gpu: bool) -> BackendInputs:
        return BackendInputs(model_path=config["model"], optimizer={"lr": config["lr"], "betas": [0.9, 0.95]},
                             reference=config.get("kl", False), seed=3, extra={"trainer": {"backend": "torch"}},
                             **placement(on_gpu))


def test_the_backend_is_the_frameworks_model_and_optimizer_under_the_users_config(tiny_policy):
    settings = BackendSettings(config={"trainer": {"options": {"zero_stage": 3}}, "model": {"dtype": "bfloat16"},
                                       "reference": {"micro_batch_tokens": 512}})
    config = backend_config(Mapping, {"model": str(tiny_policy), "lr": 0.25}, settings, on_gpu=False)
    assert (config.model.path, config.model.device, config.model.dtype) == (str(tiny_policy), "cpu", "bfloat16")
    assert (config.trainer.optimizer.lr, config.trainer.optimizer.betas, config.trainer.backend) == (0.25, (0.9, 0.95),
                                                                                                     "torch")
    assert config.trainer.options == {"zero_stage": 3} and config.seed == 3
    assert config.reference is not None  # the user's section, though the framework needs none
    plain = backend_config(Mapping, {"model": str(tiny_policy), "lr": 0.25}, BackendSettings(), on_gpu=True)
    assert (plain.model.dtype, plain.model.device, plain.reference) == ("bfloat16", "cuda", None)


def test_every_refusal_is_named_at_once_with_the_keys_the_framework_sets():
    settings = BackendSettings(config={"model": {"path": "/elsewhere"}, "trainer": {"optimizer": {"lr": 1.0},
                                                                                    "backend": "torch"}})
    with pytest.raises(ConfigError) as refused:
        check_supported(Mapping, {"refuse": ["lora", "critic"], "lora": 8, "critic": True}, settings)
    assert str(refused.value).splitlines() == [
        "arctic-test cannot honour these pytest settings:", "  lora=8: not here", "  critic=True: not here",
        "  arctic.config.model.path: set by the test's own config",
        "  arctic.config.trainer.optimizer: set by the test's own config"]
    with pytest.raises(ConfigError) as refused:
        check_supported(Mapping, {"refuse": ["lora"], "lora": 8}, BackendSettings())
    assert str(refused.value) == "arctic-test cannot honour this pytest setting: lora=8: not here"
    check_supported(Mapping, {}, BackendSettings(config={"trainer": {"backend": "torch"}}))  # engine choices pass


def test_the_frameworks_release_is_checked_against_the_range_the_mapping_names(monkeypatch):
    assert framework_version_problem(Mapping) is None
    monkeypatch.setattr(Mapping, "supported", ("99", "100"))
    assert framework_version_problem(Mapping) == (f"arctic-test supports pytest >=99,<100; pytest {pytest.__version__} "
                                                  "is installed (pip install 'pytest>=99,<100')")


def test_metrics_take_the_frameworks_names_with_the_policy_term_and_the_entropys_sign():
    metrics = {"ppo/loss": 0.5, "entropy/loss": -1.25, "ppo/clipfrac": 0.1}
    assert framework_metrics(metrics, Mapping.metric_names, policy="ppo") == {"pg_loss": 0.5, "entropy": 1.25}
    assert framework_metrics(metrics, Mapping.metric_names, policy="gspo") == {"entropy": 1.25}
    assert prefixed({"a": 1.0}) == {"arctic/a": 1.0}
    calls = [{"loss": 1.0, "ratio_max": 3.0, "ratio_min": 0.5}, {"loss": 2.0, "ratio_max": 2.0, "ratio_min": 0.25}]
    assert mean_over_calls(calls) == {"loss": 1.5, "ratio_max": 3.0, "ratio_min": 0.25}


@pytest.mark.parametrize("kind", ["lambda", "sequential"])
def test_a_stand_in_schedule_gives_the_schedulers_own_rates(kind):
    """The rates of a scheduler stepped alongside a real optimizer (as a framework's trainer steps
    it), asked for out of order and again."""
    def build(optimizer):
        if kind == "lambda":
            return LambdaLR(optimizer, lambda n: 1.0 / (1 + n) if n > 1 else 0.1 * (n + 1))
        return SequentialLR(optimizer, [LinearLR(optimizer, 0.1, 1.0, total_iters=3),
                                        LinearLR(optimizer, 1.0, 0.2, total_iters=4)], milestones=[3])

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([weight], lr=3e-3)
    scheduler, expected = build(optimizer), []
    for _ in range(9):
        expected.append(optimizer.param_groups[0]["lr"])
        weight.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    schedule = StandInSchedule(3e-3, build)
    assert schedule(5) == expected[5]
    assert [schedule(n) for n in range(9)] == expected
    assert len(set(expected)) > 4  # the schedule moves: a constant rate would not tell the two apart


def test_a_frameworks_section_dataclass_has_the_settings_fields_and_defaults():
    section = settings_dataclass(BackendSettings, "Section", __name__)
    fields = {f.name: f for f in dataclasses.fields(section)}
    assert list(fields) == list(BackendSettings.model_fields)
    made = section()
    assert dataclasses.asdict(made) == BackendSettings().model_dump()
    assert section().config is not made.config  # each section has a mapping of its own
    assert section.__module__ == __name__ and section.__qualname__ == "Section"


def test_grouped_sampling_opens_one_client_per_event_loop_and_pickles_without_it(tiny_policy):
    client = ArcticClient.in_process({"model": {"path": str(tiny_policy), "device": "cpu"},
                                      "trainer": {"backend": "torch"}, "seed": 0})
    opened = []

    def connect() -> AsyncArcticClient:
        opened.append(asyncio.get_running_loop())
        return AsyncArcticClient(client.transport)

    sampler = GroupedSampler(connect, quiet_s=0.05, max_wait_s=1.0)
    params = SamplingParams(n=1, max_tokens=3, seed=1)

    async def two_samples_of(sampler, params):
        return await asyncio.gather(sampler.sample([5, 6, 7], params), sampler.sample([5, 6, 7], params))

    async def two_samples():
        return await two_samples_of(sampler, params)

    first = asyncio.run(two_samples())
    assert len(opened) == 1 and first[0][0] is first[1][0] and {first[0][1], first[1][1]} == {0, 1}  # one call
    again = asyncio.run(two_samples())
    assert len(opened) == 2 and opened[0] is not opened[1]
    assert again[0][0].num_responses == 2
    # A quiet time of 0: each request sent as it comes, its own call (the server joins them).
    direct = asyncio.run(two_samples_of(GroupedSampler(connect, quiet_s=0.0, max_wait_s=1.0), params))
    assert direct[0][0] is not direct[1][0] and [d[1] for d in direct] == [0, 0]
    assert [d[0].num_responses for d in direct] == [1, 1]
    copy = pickle.loads(pickle.dumps(GroupedSampler(BackendAddress(url="http://127.0.0.1:1").async_client, 0.1, 1.0)))
    assert copy._client is None and copy.connect.__self__.url == "http://127.0.0.1:1"
    client.shutdown()


def test_the_end_of_sequence_ids_are_the_tokenizers_and_the_generation_configs(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [11, 12]}))
    assert end_of_sequence_ids(str(tmp_path), 2) == {2, 11, 12}
    assert end_of_sequence_ids(str(tmp_path / "none"), None) == set()


def test_a_named_server_must_answer_and_a_started_one_is_built_from_the_config(tiny_policy):
    from test_http import LiveServer

    config = {"model": {"path": str(tiny_policy), "device": "cpu"}, "trainer": {"backend": "torch"}, "seed": 0}
    live = LiveServer(create_app(ArcticServer(ArcticConfig.from_dict(config))))
    try:
        client, address = open_backend(BackendSettings(url=live.url), lambda: pytest.fail("nothing to start"))
        assert address == BackendAddress(url=live.url, timeout=600.0) and client.status().info["config"]
        connect = async_connect(client, BackendSettings(url=live.url))
        assert connect.__self__ == address
        client.close()
    finally:
        live.stop()
    with pytest.raises(Exception, match="ConnectError|connect"):
        open_backend(BackendSettings(url=live.url), lambda: pytest.fail("nothing to start"))
    started, address = open_backend(BackendSettings(), lambda: config)
    assert address is None and async_connect(started, BackendSettings())().transport is started.transport
    started.shutdown()


def test_a_checkpoints_export_is_placed_where_each_framework_reads_its_model(tiny_policy, tmp_path):
    client = ArcticClient.in_process({"model": {"path": str(tiny_policy), "device": "cpu"},
                                      "trainer": {"backend": "torch"}, "seed": 0})
    checkpoint = tmp_path / "step_1"
    client.save_checkpoint(str(checkpoint), export_hf=True)
    link_export(checkpoint, checkpoint / "huggingface")  # verl's place
    assert (checkpoint / "huggingface" / "config.json").is_file()
    assert not Path((checkpoint / "huggingface").readlink()).is_absolute()
    link_export_files(checkpoint, tmp_path)  # TRL's: the output folder itself
    assert (tmp_path / "config.json").resolve() == (checkpoint / HF_EXPORT / "config.json").resolve()
    export = tmp_path / "export" / "final"  # SkyRL's: a folder of its own, replaced whole
    export.mkdir(parents=True)
    (export / "stale.txt").write_text("old")
    export_model(client, export)
    assert (export / "config.json").is_file() and not (export / "stale.txt").exists()
    assert sorted(p.name for p in export.parent.iterdir()) == ["final"]  # no scratch left beside it
    assert not (export / STATE_FILE).exists()
    without = tmp_path / "no-export"
    client.save_checkpoint(str(without))
    link_export(without, without / "huggingface")
    assert not (without / "huggingface").exists()
    client.shutdown()

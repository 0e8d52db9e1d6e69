"""The vllm sampling backend: a missing or unsupported vLLM, or bad options, are refused by name
before any engine starts; against a stand-in for vLLM's AsyncLLM (``fake_async_vllm``), calls from
many threads share its steps, a cancelled call leaves its batch, and weights swapped mid-call are
reported per token. (Generation through vLLM itself needs the GPU machine.)"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import fake_async_vllm

from arctic_core.config import ModelConfig, SamplerConfig, SamplingParams
from arctic_core.errors import ConfigError, RequestCancelled, RequestError
from arctic_core.plugins.interfaces import ConcurrentSampling
from arctic_core.plugins.registry import default_registry
from arctic_fca.vllm.plugin import BASE_ENV


def build(options: dict | None = None):
    factory = default_registry().get("sampling_backend", "vllm")
    return factory(SamplerConfig(backend="vllm", options=options or {}), ModelConfig(path="policy"), seed=0)


def test_without_vllm_the_backend_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"needs vLLM 0\.24\.x: pip install 'arctic-fca\[vllm\]'"):
        build()


def test_another_vllm_release_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.33.0"))
    with pytest.raises(ConfigError, match=r"supports vLLM 0\.24\.x; this environment has 0\.33\.0"):
        build()


def test_an_engine_that_fails_to_start_leaves_no_loop_thread(fake_vllm, monkeypatch):
    def fails(args, stat_loggers):
        raise RuntimeError("Engine core initialization failed")

    monkeypatch.setattr(fake_vllm.AsyncLLMEngine, "from_engine_args", fails)
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        build()
    assert "arctic-vllm" not in {t.name for t in threading.enumerate()} - before


def test_bad_options_are_named():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        build({"gpu_memory_utilization": 2})


@pytest.fixture
def fake_vllm(monkeypatch):
    module = fake_async_vllm.install(monkeypatch)
    monkeypatch.setenv(BASE_ENV, "restored after the test")
    return module


@pytest.fixture
def sampler(fake_vllm):
    sampler = build()
    yield sampler
    sampler.shutdown()


def test_fca_is_vllms_custom_backend_unless_switched_off(fake_vllm):
    sampler = build()
    assert sampler.engine.args.attention_config == {"backend": "CUSTOM"}
    assert sampler.engine.rpcs == ["arctic_fca_attach_host_tables"]  # the builders get the host's block tables
    assert os.environ[BASE_ENV] == "FLASH_ATTN"  # what the plugin registers in vLLM's processes
    assert not sampler.engine.args.disable_log_stats  # load() reads the scheduler's stats
    build({"fca_base": "TRITON_ATTN"})
    assert os.environ[BASE_ENV] == "TRITON_ATTN"
    plain = build({"fca": False})
    assert not hasattr(plain.engine.args, "attention_config") and plain.engine.rpcs == []
    chosen = build({"engine_args": {"attention_config": {"backend": "FLASHINFER"}}}).engine.args
    assert chosen.attention_config == {"backend": "FLASHINFER"}  # the user's explicit choice wins


def test_greedy_samples_are_one_request_repeated_and_sampling_asks_for_n(sampler):
    greedy = sampler.generate([[10, 11], [20]], SamplingParams(n=3, temperature=0.0, max_tokens=2))
    assert sampler.engine.requests[-1].n == 1  # vLLM refuses n > 1 for greedy decoding
    assert [greedy.response(i) for i in range(6)] == [[0, 1]] * 6
    assert greedy.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    sampled = sampler.generate([[10]], SamplingParams(n=3, temperature=1.0, max_tokens=2))
    assert sampler.engine.requests[-1].n == 3 and sampler.engine.requests[-1].logprobs == 0
    assert [sampled.response(i) for i in range(3)] == [[0, 1], [10, 11], [20, 21]]  # by sample index
    assert sampled.sampling_logprobs[0, :2].tolist() == [-0.25, -0.5]
    assert sampled.policy_version.tolist() == [0, 0, 0]


def test_prompts_vllm_cannot_take_are_refused_by_name_before_vllm_sees_them(sampler):
    with pytest.raises(RequestError, match=r"prompts\[1\] contain token id 1000 >= vocab size 1000"):
        sampler.generate([[5], [7, 1000]], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match=r"prompts\[0\] \(60 tokens\) \+ max_tokens=8 exceeds max_model_len=64"):
        sampler.generate([[5] * 60], SamplingParams(max_tokens=8))
    with pytest.raises(RequestError, match=r"prompts\[1\] is empty"):
        sampler.generate([[5], []], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match=r"stop_token_ids \[1000\] are >= the vocabulary size 1000"):
        sampler.generate([[5]], SamplingParams(max_tokens=4, stop_token_ids=[1000]))
    with pytest.raises(RequestError, match=r"prompts\[0\] contain a negative token id -3"):
        sampler.generate([[5, -3]], SamplingParams(max_tokens=4))
    assert sampler.engine.requests == []  # nothing reached the engine
    assert sampler.generate([[5] * 60], SamplingParams(max_tokens=4)).num_responses == 1


def test_calls_from_many_threads_share_vllms_steps(sampler):
    assert isinstance(sampler, ConcurrentSampling)  # the server sends it generate calls side by side
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8)
    together = threading.Barrier(32)  # sent at once, however slowly the threads start

    def call(prompt: int):
        together.wait(timeout=10)
        return sampler.generate([[prompt]], params)

    with ThreadPoolExecutor(32) as pool:
        batches = list(pool.map(call, range(1, 33)))
    for batch in batches:
        assert [batch.response(i) for i in range(2)] == [list(range(8)), list(range(10, 18))]
    assert sampler.engine.steps < 8 * 8, "32 calls of 8 tokens one after another take 256 steps"
    assert sampler.load()["requests"] == 0


def test_a_cancelled_call_leaves_vllms_batch_and_the_others_go_on(sampler):
    long = sampler.submit([[1], [2]], SamplingParams(n=2, max_tokens=60))
    short = sampler.submit([[3]], SamplingParams(n=1, max_tokens=20))
    wait_for(lambda: sampler.load()["running"] >= 5 and sampler.load()["kv_used_blocks"] >= 5)
    assert sampler.load()["requests"] == 2
    long.cancel()
    with pytest.raises(RequestCancelled):
        long.wait(timeout=5)
    wait_for(lambda: len(sampler.engine.aborted) == 2)  # both of its prompts' requests
    assert short.wait(timeout=5).response(0) == list(range(20))
    assert sampler.engine.running == {} and sampler.load()["requests"] == 0


def test_weights_swapped_mid_call_stamp_each_token_with_the_version_that_drew_it(sampler):
    pending = [sampler.submit([[1], [2]], SamplingParams(n=3, max_tokens=40)) for _ in range(4)]
    for version in (1, 2):
        wait_for(lambda steps=12 * version: sampler.engine.steps >= steps)
        sampler.update_weights([("version", torch.tensor(version))], version)
    spanning = 0
    for batch in (p.wait(timeout=10) for p in pending):
        for row in range(batch.num_responses):
            tokens = torch.tensor(batch.response(row))
            versions = batch.token_policy_version[row, : len(tokens)]
            assert torch.equal(versions, tokens // 1000), "a token reported with weights that did not draw it"
            assert batch.policy_version[row] == versions.min()
            spanning += int(versions.min() < versions.max())
    assert spanning == 24  # every sample was drawn by more than one version
    assert sampler.engine.resets == [True, True]  # cached KV of the old weights dropped, in-flight recomputed
    assert sampler.policy_version == 2


def test_fca_stats_are_summed_over_the_workers(sampler, fake_vllm):
    assert sampler.fca_stats() == {"decode": 5, "mixed": 1}
    assert build({"fca": False}).fca_stats() == {}


def test_sleep_refuses_calls_until_wake_and_shutdown_cancels_calls_in_flight(sampler):
    sampler.sleep()
    with pytest.raises(RequestError, match=r"the sampler is asleep; call wake\(\['sampler'\]\) first"):
        sampler.submit([[1]], SamplingParams(max_tokens=4))
    sampler.wake()
    assert sampler.engine.rpcs[-2:] == ["sleep(1)", "wake_up"]
    pending = sampler.submit([[1]], SamplingParams(max_tokens=60))
    wait_for(lambda: sampler.load()["running"] == 1)
    sampler.shutdown()
    with pytest.raises(RequestCancelled):
        pending.wait(timeout=5)


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_the_plugin_names_an_unknown_base_backend(monkeypatch):
    from arctic_fca.vllm import plugin as vllm_plugin

    monkeypatch.setenv(BASE_ENV, "FLASHINFER")
    with pytest.raises(ValueError, match=(r"ARCTIC_FCA_VLLM_BASE='FLASHINFER': "
                                          r"FCA extends one of \['FLASH_ATTN', 'TRITON_ATTN'\]")):
        vllm_plugin.register()


def test_an_unknown_fca_base_option_is_refused_by_name():
    with pytest.raises(ConfigError, match="fca_base"):
        build({"fca_base": "FLASHINFER"})



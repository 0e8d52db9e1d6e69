"""The vllm sampling backend's gate: a missing or unsupported vLLM, or bad options, are refused by
name before any engine starts. (Generation through vLLM needs the GPU machine.)"""

from __future__ import annotations

import os
import sys
import types

import pytest

from arctic_core.config import ModelConfig, SamplerConfig
from arctic_core.errors import ConfigError, RequestError
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


def test_bad_options_are_named():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        build({"gpu_memory_utilization": 2})


class RecordingLLM:
    """Stands in for ``vllm.LLM``: records what the sampler asks for and answers like vLLM 0.24
    (one output per prompt, n samples, a {token: Logprob} dict per generated token)."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.requests, self.rpcs = kwargs, [], []
        model_config = types.SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 1000)
        self.llm_engine = types.SimpleNamespace(model_config=model_config)

    def collective_rpc(self, method, args=()):
        self.rpcs.append(method)
        return [None]

    def generate(self, prompts, sampling, use_tqdm=False):
        self.requests.append(sampling)
        def sample(prompt, index):
            tokens = [prompt["prompt_token_ids"][0] + index + step for step in range(sampling.max_tokens)]
            return types.SimpleNamespace(index=index, token_ids=tokens,
                                         logprobs=[{t: types.SimpleNamespace(logprob=-0.5 * (i + 1))}
                                                   for i, t in enumerate(tokens)])
        return [types.SimpleNamespace(outputs=[sample(p, i) for i in reversed(range(sampling.n))]) for p in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.SimpleNamespace(__version__="0.24.0", LLM=RecordingLLM,
                                   SamplingParams=lambda **kwargs: types.SimpleNamespace(**kwargs))
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setenv(BASE_ENV, "restored after the test")
    return module


def test_fca_is_vllms_custom_backend_unless_switched_off(fake_vllm):
    llm = build().llm
    assert llm.kwargs["attention_config"] == {"backend": "CUSTOM"}
    assert llm.rpcs == ["arctic_fca_attach_host_tables"]  # the builders get the host's block tables
    assert os.environ[BASE_ENV] == "FLASH_ATTN"  # what the plugin registers in vLLM's processes
    build({"fca_base": "TRITON_ATTN"})
    assert os.environ[BASE_ENV] == "TRITON_ATTN"
    assert "attention_config" not in build({"fca": False}).llm.kwargs and build({"fca": False}).llm.rpcs == []
    chosen = build({"engine_args": {"attention_config": {"backend": "FLASHINFER"}}}).llm.kwargs
    assert chosen["attention_config"] == {"backend": "FLASHINFER"}  # the user's explicit choice wins


def test_greedy_samples_are_one_request_repeated_and_sampling_asks_for_n(fake_vllm):
    from arctic_core.config import SamplingParams

    sampler = build()
    greedy = sampler.generate([[10, 11], [20]], SamplingParams(n=3, temperature=0.0, max_tokens=2))
    assert sampler.llm.requests[-1].n == 1  # vLLM refuses n > 1 for greedy decoding
    assert [greedy.response(i) for i in range(6)] == [[10, 11]] * 3 + [[20, 21]] * 3
    assert greedy.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    sampled = sampler.generate([[10]], SamplingParams(n=3, temperature=1.0, max_tokens=2))
    assert sampler.llm.requests[-1].n == 3 and sampler.llm.requests[-1].logprobs == 0
    assert [sampled.response(i) for i in range(3)] == [[10, 11], [11, 12], [12, 13]]  # by sample index
    assert sampled.sampling_logprobs[0, :2].tolist() == [-0.5, -1.0]


def test_prompts_vllm_cannot_take_are_refused_by_name_before_vllm_sees_them(fake_vllm):
    from arctic_core.config import SamplingParams

    sampler = build()
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
    assert sampler.llm.requests == []  # nothing reached the engine
    assert sampler.generate([[5] * 60], SamplingParams(max_tokens=4)).num_responses == 1


def test_the_plugin_names_an_unknown_base_backend(monkeypatch):
    from arctic_fca.vllm import plugin as vllm_plugin

    monkeypatch.setenv(BASE_ENV, "FLASHINFER")
    with pytest.raises(ValueError, match=(r"ARCTIC_FCA_VLLM_BASE='FLASHINFER': "
                                          r"FCA extends one of \['FLASH_ATTN', 'TRITON_ATTN'\]")):
        vllm_plugin.register()


def test_an_unknown_fca_base_option_is_refused_by_name():
    with pytest.raises(ConfigError, match="fca_base"):
        build({"fca_base": "FLASHINFER"})


def test_fca_stats_are_summed_over_the_workers(fake_vllm):
    sampler = build()
    sampler.llm.collective_rpc = lambda method: [{"decode": 2, "reuse": 1}, {"decode": 3, "mixed": 1}]
    assert sampler.fca_stats() == {"decode": 5, "reuse": 1, "mixed": 1}
    assert build({"fca": False}).fca_stats() == {}

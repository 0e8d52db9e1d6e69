"""verl's sampling requests in Arctic's terms."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from arctic_core.config import SamplingParams
from arctic_verl.mapping import to_sampling_params, with_server_defaults


ROLLOUT = OmegaConf.create({"prompt_length": 16, "response_length": 32})


def test_verl_sampling_params_map_or_are_refused_by_name():
    params, logprobs = to_sampling_params({"temperature": 0.7, "top_p": 0.9, "top_k": -1, "logprobs": 0,
                                           "repetition_penalty": 1.1}, ROLLOUT, prompt_len=4)
    assert params == SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=0, repetition_penalty=1.1, max_tokens=32)
    assert not logprobs
    assert to_sampling_params({"logprobs": True, "max_tokens": 8}, ROLLOUT, 4)[0].max_tokens == 8
    assert to_sampling_params({"max_new_tokens": 5}, ROLLOUT, 4)[0].max_tokens == 5
    with pytest.raises(ValueError, match=r"\['presence_penalty'\] have no Arctic meaning"):
        to_sampling_params({"presence_penalty": 0.5}, ROLLOUT, 4)


def test_requests_get_the_defaults_verls_vllm_server_adds():
    """verl's server fills in the rollout's repetition penalty and ignore_eos, and a length within
    the rollout's budget (a later turn's longer prompt leaves less)."""
    rollout = OmegaConf.create({"prompt_length": 16, "response_length": 8, "ignore_eos": True,
                                "repetition_penalty": 1.2})
    params, _ = to_sampling_params({"temperature": 1.0}, rollout, prompt_len=4)
    assert (params.ignore_eos, params.repetition_penalty, params.max_tokens) == (True, 1.2, 8)
    assert to_sampling_params({}, rollout, prompt_len=20)[0].max_tokens == 4  # 16 + 8 - 20
    assert with_server_defaults({}, rollout, prompt_len=30)["max_tokens"] == 1
    asked = with_server_defaults({"max_tokens": 3, "ignore_eos": False, "repetition_penalty": 1.0}, rollout, 4)
    assert (asked["max_tokens"], asked["ignore_eos"], asked["repetition_penalty"]) == (3, False, 1.0)
    plain = OmegaConf.create({"prompt_length": 16, "response_length": 8})
    assert to_sampling_params({}, plain, 4)[0] == SamplingParams(n=1, max_tokens=8)

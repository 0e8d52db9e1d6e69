"""verl's sampling requests in Arctic's terms."""

from __future__ import annotations

import pytest

from arctic_core.config import SamplingParams
from arctic_verl.mapping import to_sampling_params


def test_verl_sampling_params_map_or_are_refused_by_name():
    params, logprobs = to_sampling_params({"temperature": 0.7, "top_p": 0.9, "top_k": -1, "logprobs": 0,
                                           "repetition_penalty": 1.1}, response_length=32)
    assert params == SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=0, repetition_penalty=1.1, max_tokens=32)
    assert not logprobs
    assert to_sampling_params({"logprobs": True, "max_tokens": 8}, response_length=32)[0].max_tokens == 8
    with pytest.raises(ValueError, match=r"\['presence_penalty'\] have no Arctic meaning"):
        to_sampling_params({"presence_penalty": 0.5}, response_length=32)

"""SkyRL's generator calls, served by Arctic: per-trajectory requests reach the sampler as prompt
groups, and the outputs are in SkyRL's shape (token ids, text, stop reasons, log-probs)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
from skyrl.train.config.config import SamplingParams as SkyRLSampling
from transformers import AutoTokenizer, GenerationConfig

from arctic_core.adapters.settings import BackendSettings
from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient, AsyncArcticClient
from arctic_core.config import SamplingParams
from arctic_core.transports.inprocess import InProcessTransport
from arctic_skyrl.inference import ArcticInferenceClient

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
MAX_TOKENS = 6


class RecordingTransport(InProcessTransport):
    """The in-process server, with a record of each ``generate``: (prompts, n)."""

    def __init__(self, server) -> None:
        super().__init__(server)
        self.generates: list[tuple[list[list[int]], int]] = []

    async def acall(self, op, request):
        if op == "generate":
            self.generates.append((request.prompts, request.params.n))
        return await super().acall(op, request)


@pytest.fixture
def served(policy):
    with ArcticClient.in_process({"model": {"path": str(policy), "device": "cpu"}, "seed": 0,
                                  "trainer": {"backend": "torch"}}) as arctic:
        transport = RecordingTransport(arctic.transport.server)
        sampling = get_sampling_params_for_backend("vllm", SkyRLSampling(max_generate_length=MAX_TOKENS))
        client = ArcticInferenceClient(lambda: AsyncArcticClient(transport), AutoTokenizer.from_pretrained(policy),
                                       str(policy), sampling, BackendSettings(group_quiet_ms=50))
        yield client, transport


def check_outputs(client, output, count: int) -> None:
    assert len(output["response_ids"]) == count
    for ids, text, reason, logprobs in zip(output["response_ids"], output["responses"], output["stop_reasons"],
                                           output["response_logprobs"], strict=True):
        assert 1 <= len(ids) <= MAX_TOKENS and len(logprobs) == len(ids)
        assert text == client.tokenizer.decode(ids, skip_special_tokens=True)
        ended = ids[-1] == client.tokenizer.eos_token_id
        assert reason == ("stop" if ended or len(ids) < MAX_TOKENS else "length")


def test_per_trajectory_calls_reach_arctic_as_prompt_groups(served):
    client, transport = served

    async def run():
        calls = [client.generate({"prompt_token_ids": [prompt], "sampling_params": None})
                 for prompt in PROMPTS for _ in range(4)]
        return await asyncio.gather(*calls)

    outputs = asyncio.run(run())
    assert transport.generates == [(PROMPTS, 4)]  # one call: each prompt once, n = its 4 trajectories
    for output in outputs:
        check_outputs(client, output, 1)


def test_a_batched_call_is_sent_grouped_and_answered_in_order(served):
    client, transport = served
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3 + [PROMPTS[2]]
    output = asyncio.run(client.generate({"prompt_token_ids": prompts, "sampling_params": None}))
    assert sorted(transport.generates, key=lambda call: call[1]) == [([PROMPTS[2]], 1), ([PROMPTS[0], PROMPTS[1]], 3)]
    check_outputs(client, output, len(prompts))


def test_ignore_eos_samples_run_to_max_tokens_and_end_by_length(served):
    """vLLM's ``ignore_eos``: the end-of-sequence token no longer ends a sample (nor makes it "stop")."""
    client, _ = served
    sampling = {**client.default_sampling, "ignore_eos": True, "temperature": 1.0, "seed": 3}
    output = asyncio.run(client.generate({"prompt_token_ids": PROMPTS * 4, "sampling_params": sampling}))
    assert all(len(ids) == MAX_TOKENS for ids in output["response_ids"])
    assert output["stop_reasons"] == ["length"] * len(PROMPTS) * 4


def test_requests_arctic_cannot_honour_are_refused_by_name(served):
    client, _ = served
    with pytest.raises(ValueError, match="stop strings"):
        asyncio.run(client.generate({"prompt_token_ids": [PROMPTS[0]],
                                     "sampling_params": {"max_tokens": 4, "stop": ["###"]}}))
    with pytest.raises(ValueError, match=r"\['best_of'\] have no Arctic meaning"):
        asyncio.run(client.generate({"prompt_token_ids": [PROMPTS[0]],
                                     "sampling_params": {"max_tokens": 4, "best_of": 2}}))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        asyncio.run(client.generate({"prompts": [[{"role": "user", "content": "hi"}]]}))


def test_the_generation_configs_end_of_sequence_ids_end_a_sample_by_stop(policy, tmp_path):
    """A chat model's generation config lists end-of-sequence ids beside the tokenizer's (as vLLM
    reads them, they end a sample): a full-length sample ending in one stopped, it did not run out."""
    folder = tmp_path / "model"
    shutil.copytree(policy, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, 7]).save_pretrained(folder)
    client = ArcticInferenceClient(None, tokenizer, str(folder), {}, BackendSettings())
    batch = RolloutBatch.from_lists([[3, 4]], [[5, 6, 8, 9, 10, 7], [5, 6, 8, 9, 10, 11]], [0, 0])
    output = client._output([(batch, 0), (batch, 1)], SamplingParams(max_tokens=6), want_logprobs=False)
    assert output["stop_reasons"] == ["stop", "length"]
    ignoring = client._output([(batch, 0)], SamplingParams(max_tokens=6, ignore_eos=True), want_logprobs=False)
    assert ignoring["stop_reasons"] == ["length"]

"""PRIME-RL's inference routes, answered by Arctic on a real loopback server.

The generate body is the one PRIME-RL's environment server sent (``fixtures/generate_request.json``,
recorded from PRIME-RL 0.8's env server and renderer client), with this model's prompt tokens.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import re
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families
import pytest
import torch
from transformers import AutoTokenizer

from arctic_core.batch import RolloutBatch
from arctic_core.demo.grpo import chat_prompt_ids
from arctic_core.demo.task import CountingTask
from arctic_primerl.inference import FrontMetrics, FrontState
from runs import FIXTURES, serving

RECORDED = json.loads((FIXTURES / "generate_request.json").read_text())
TOKEN = "secret"  # PRIME-RL's clients send $VLLM_API_KEY as a bearer token
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def front(policy, tmp_path_factory):
    """The service and an httpx client of its front; records each Arctic generate call."""
    with serving(tmp_path_factory.mktemp("front"), policy, token=TOKEN, seq_len=64) as (service, url):
        calls = []
        server = service.client.transport.server  # the embedded Arctic server both sides call
        run = server._run  # where the blocking and the async calls meet

        def recording_run(op, request, cancel):
            if op == "generate":
                calls.append(request)
            return run(op, request, cancel)

        server._run = recording_run
        with httpx.Client(base_url=url, timeout=120, headers=AUTH) as http:
            yield service, http, calls


def body(policy, problem_index: int = 0, **sampling) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(policy)
    request = copy.deepcopy(RECORDED["body"])
    request["model"] = str(policy)
    request["token_ids"] = chat_prompt_ids(tokenizer, CountingTask().problems()[problem_index])
    request["sampling_params"].update({"max_tokens": 8, "stop_token_ids": [tokenizer.eos_token_id], **sampling})
    return request


def test_generate_answers_as_vllm_with_the_samplers_processed_logprobs(front, policy):
    service, http, _ = front
    request = body(policy, temperature=0.7)
    answer = http.post("/inference/v1/generate", json=request, headers={**RECORDED["headers"], **AUTH})
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    tokens, content = choice["token_ids"], choice["logprobs"]["content"]
    assert 1 <= len(tokens) <= 8 and len(content) == len(tokens)
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in tokens]  # the renderer client checks these
    assert choice["finish_reason"] in ("stop", "length")
    # The log-probs are those of the sampled tokens at the sampling temperature (vLLM's processed ones).
    batch = RolloutBatch.from_lists([request["token_ids"]], [tokens], [0])
    want = service.client.log_probs(batch, temperature=0.7).outputs["logprobs"][0, : len(tokens)]
    got = torch.tensor([c["logprob"] for c in content])
    assert torch.allclose(got, want, atol=1e-5)


def test_one_prompts_calls_reach_arctic_as_one_group(front, policy):
    service, http, calls = front
    calls.clear()

    async def group():
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=120, headers=AUTH) as client:
            return await asyncio.gather(*(client.post("/inference/v1/generate", json=body(policy, 3))
                                          for _ in range(4)))

    answers = asyncio.run(group())
    assert all(a.status_code == 200 for a in answers)
    assert [(len(call.prompts), call.params.n) for call in calls] == [(1, 4)]  # one prompt, four samples, one call


def test_samples_stop_at_the_context_without_max_tokens_or_past_it(front, policy):
    """As PRIME-RL's server: no max_tokens, or more than the context leaves, samples up to the
    context and finishes with "length"; only a prompt past the context is refused."""
    _, http, calls = front
    eos = AutoTokenizer.from_pretrained(policy).eos_token_id
    for max_tokens in (None, 4096):
        calls.clear()
        request = body(policy, temperature=1.0, stop_token_ids=[], max_tokens=max_tokens)
        answer = http.post("/inference/v1/generate", json=request).json()["choices"][0]
        room = 64 - len(request["token_ids"])
        assert [call.params.max_tokens for call in calls] == [room], max_tokens
        if answer["finish_reason"] == "length":
            assert len(answer["token_ids"]) == room
        else:  # the sample drew the end-of-sequence token first
            assert answer["finish_reason"] == "stop" and answer["token_ids"][-1] == eos
    too_long = {**body(policy), "token_ids": body(policy)["token_ids"] * 64}
    refused = http.post("/inference/v1/generate", json=too_long)
    assert refused.status_code == 400 and "the model's context is 64" in refused.json()["message"]


def test_requests_arctic_cannot_honour_are_refused_by_name(front, policy):
    _, http, _ = front
    cases = {
        "is not served": {**body(policy), "model": "other"},
        "sampling_params.stop": body(policy, stop=["\n"]),
        "sampling_params.presence_penalty": body(policy, presence_penalty=0.5),
        "sampling_params.logprobs = 5": body(policy, logprobs=5),
        "unknown sampling_params \\['typo'\\]": body(policy, typo=1),
        "temperature: Input should be a valid number": body(policy, temperature="hot"),
        "max_tokens: Input should be greater than or equal to 1": body(policy, max_tokens=-1),
        "stop_token_ids.1: Input should be a valid integer": body(policy, stop_token_ids=[2, "a"]),
        "sampling_params.logprobs = 'x'": body(policy, logprobs="x"),
        "multimodal": {**body(policy), "features": {"image": 1}},
    }
    for message, request in cases.items():
        answer = http.post("/inference/v1/generate", json=request)
        assert answer.status_code in (400, 404), (message, answer.text)
        assert re.search(message, answer.json()["message"]), answer.text


def test_weight_updates_pause_and_resume_follow_the_trainer(front, policy):
    service, http, _ = front
    run_dir = service.run.run_dir
    service.trainer.announced = 0
    assert (http.post("/update_weights", json={"weight_dir": str(run_dir / "broadcasts" / "step_0")}).json()
            == {"status": "ok"})
    late = http.post("/update_weights", json={"weight_dir": str(run_dir / "broadcasts" / "step_3")})
    assert late.status_code == 409 and "step 3 were not trained by Arctic" in late.json()["message"]
    assert http.post("/update_weights", json={"weight_dir": None}).status_code == 400
    assert http.post("/init_broadcaster", json={}).status_code == 404  # PRIME-RL then skips NCCL
    assert http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "b"}).status_code == 400

    async def paused_generate():
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=120, headers=AUTH) as client:
            assert (await client.post("/pause", params={"mode": "keep", "clear_cache": "false"})).status_code == 200
            pending = asyncio.ensure_future(client.post("/inference/v1/generate", json=body(policy)))
            await asyncio.sleep(0.5)
            held = not pending.done()
            metrics = (await client.get("/metrics")).text
            await client.post("/resume")
            return held, metrics, await pending

    served = metric(http, "arctic:requests_served_total")
    held, metrics, answer = asyncio.run(paused_generate())
    assert held and 'vllm:num_requests_waiting{engine="0"} 1.0' in metrics
    assert answer.status_code == 200
    assert metric(http, "arctic:requests_served_total") == served + 1
    assert (metric(http, "vllm:num_requests_waiting", engine="0")
            == metric(http, "vllm:num_preemptions_total", engine="0") == 0)


def metric(http, name: str, **labels: str) -> float:
    """One sample of the front's /metrics, parsed as Prometheus text."""
    text = http.get("/metrics").text
    return next(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == name and sample.labels == labels)


def load_metrics(text: str) -> dict[str, tuple[str, float]]:
    """The vLLM load metrics of a /metrics text as PRIME-RL's orchestrator parses them: by family
    name, its type and the value of engine "0"'s sample (a counter's ``_total`` one)."""
    return {family.name: (family.type, sample.value) for family in text_string_to_metric_families(text)
            for sample in family.samples if family.name.startswith("vllm:") and sample.labels == {"engine": "0"}
            and not sample.name.endswith("_created")}


def test_metrics_report_the_samplers_load_while_it_samples(front, policy, monkeypatch):
    """/metrics reads the sampler's load from the server at each scrape: the samples decoding and
    the KV cache's blocks they hold while a group samples, none once it has finished."""
    service, http, _ = front
    engine = service.client.transport.server.sampler.engine
    decoding, release = threading.Event(), threading.Event()
    count_load = engine._count_load

    def count_and_hold() -> None:
        """The engine's loop, once it counts samples decoding, waits until the test has scraped."""
        count_load()
        if engine._load["running"] and not release.is_set():
            decoding.set()
            release.wait(60)

    monkeypatch.setattr(engine, "_count_load", count_and_hold)
    request = body(policy, 2, max_tokens=8, ignore_eos=True, stop_token_ids=[])

    async def scrape_while_sampling():
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=120, headers=AUTH) as client:
            group = [asyncio.ensure_future(client.post("/inference/v1/generate", json=request)) for _ in range(2)]
            try:
                assert await asyncio.to_thread(decoding.wait, 60)
                during, load = load_metrics((await client.get("/metrics")).text), engine.load()
            finally:
                release.set()
            return during, load, await asyncio.gather(*group)

    during, load, answers = asyncio.run(scrape_while_sampling())
    assert all(a.status_code == 200 for a in answers)
    # The group's two samples decode (one call, n=2) and hold KV blocks; the types are vLLM's.
    assert load["running"] == 2 and load["kv_used_blocks"] > 0
    assert during == {"vllm:num_requests_running": ("gauge", 2), "vllm:num_requests_waiting": ("gauge", 0),
                      "vllm:kv_cache_usage_perc": ("gauge", load["kv_used_blocks"] / load["kv_blocks"]),
                      "vllm:num_preemptions": ("counter", engine.stats.preempted)}
    after = load_metrics(http.get("/metrics").text)
    assert [after[name][1] for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                        "vllm:kv_cache_usage_perc")] == [0, 0, 0]


def test_metrics_fall_back_to_the_fronts_own_counts_without_a_sampler_load():
    """A server that reports no sampler load (older, or a sampler that counts nothing): the
    requests this front holds, and no KV use or preemption."""
    metrics = FrontMetrics(FrontState(lambda: 0, running=3, waiting=1))
    assert load_metrics(metrics.render({}).decode()) == {
        "vllm:num_requests_running": ("gauge", 3), "vllm:num_requests_waiting": ("gauge", 1),
        "vllm:kv_cache_usage_perc": ("gauge", 0), "vllm:num_preemptions": ("counter", 0)}


def test_health_models_and_chat_for_evaluations(front, policy):
    _, http, _ = front
    assert http.get("/health").json() == {"status": "ok"}
    (model,) = http.get("/v1/models").json()["data"]
    assert model["id"] == str(policy) and model["max_model_len"] == 64
    chat = http.post("/v1/chat/completions", json={"model": str(policy),
                                                   "messages": [{"role": "user", "content": "repeat 3"}],
                                                   "max_tokens": 6, "n": 2}).json()
    assert len(chat["choices"]) == 2 and all(isinstance(c["message"]["content"], str) for c in chat["choices"])
    # PRIME-RL's evaluation sampling arguments: top_k and min_p come in extra_body, logprobs asked for.
    messages = {"model": str(policy), "messages": [{"role": "user", "content": "repeat 3"}]}
    asked = {**messages, "max_completion_tokens": 5, "temperature": 0.0, "top_k": 4, "min_p": 0.1, "logprobs": True,
             "reasoning_effort": "low"}
    answer = http.post("/v1/chat/completions", json=asked).json()
    content = answer["choices"][0]["logprobs"]["content"]  # one entry per sampled token
    assert len(content) == answer["usage"]["completion_tokens"] <= 5
    assert all(isinstance(entry["token"], str) and entry["logprob"] <= 0.0 for entry in content)
    # Settings Arctic cannot honour are refused by name, not dropped.
    for key, value in {"stop": ["\n"], "presence_penalty": 0.5, "tools": [{"type": "function"}], "top_logprobs": 3,
                       "temperature": -1}.items():
        refused = http.post("/v1/chat/completions", json={**messages, key: value})
        assert refused.status_code == 400 and key in refused.json()["message"], refused.text
    for key, value in [("n", 0), ("n", 10**6), ("messages", "hi"), ("chat_template_kwargs", 5)]:  # the chat fields
        refused = http.post("/v1/chat/completions", json={**messages, key: value})
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", key], refused.text


def test_chat_requests_default_to_the_models_generation_config(policy, tmp_path):
    """As vLLM's chat server: settings a request leaves out come from the model's
    generation_config.json, whose end-of-sequence ids also stop every sample."""
    folder = tmp_path / "policy"
    shutil.copytree(policy, folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {**generation, "do_sample": True, "temperature": 0.25, "top_k": 3,
         "eos_token_id": [tokenizer.eos_token_id, 7]}))
    with serving(tmp_path, folder, seq_len=64) as (service, url):
        server, calls = service.client.transport.server, []
        run = server._run  # where the blocking and the async calls meet
        server._run = lambda op, request, cancel: (calls.append(request) if op == "generate" else None) \
            or run(op, request, cancel)
        messages = {"model": str(folder), "messages": [{"role": "user", "content": "repeat 3"}], "max_tokens": 4}
        with httpx.Client(base_url=url, timeout=120) as http:
            assert http.post("/v1/chat/completions", json=messages).status_code == 200
            assert http.post("/v1/chat/completions",
                             json={**messages, "top_k": 0, "temperature": 1.0}).status_code == 200
            assert http.post("/inference/v1/generate", json=body(folder, stop_token_ids=[9])).status_code == 200
            ignoring = body(folder, stop_token_ids=[9], ignore_eos=True)
            assert http.post("/inference/v1/generate", json=ignoring).status_code == 200
    (defaults, asked, generated, ignored) = [call.params for call in calls]
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.25, 3, 1.0)
    assert (asked.temperature, asked.top_k) == (1.0, 0)  # what a request names wins
    assert set(defaults.stop_token_ids) == {tokenizer.eos_token_id, 7}
    assert set(generated.stop_token_ids) == {tokenizer.eos_token_id, 7, 9}  # the request's stop ids add to them
    assert ignored.stop_token_ids == [9] and ignored.ignore_eos


def test_a_token_is_required_when_prime_rls_api_key_is_set(front):
    _, http, _ = front
    url = str(http.base_url)
    assert httpx.get(f"{url}/health").status_code == 200  # open: it reveals nothing
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200

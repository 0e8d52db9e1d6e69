"""Calls side by side: generate calls of many clients share the embedded engine's steps, training
runs beside generation, weight sync stamps each token's version, lifecycle calls run alone, a caller
that goes away cancels its request, and a full server answers busy (429).

Every test runs a real server (in process, or uvicorn on loopback) on the tiny policy, fp32 CPU.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from arctic_core import wire
from arctic_core.client import ArcticClient, AsyncArcticClient
from arctic_core.config import ArcticConfig, SamplingParams
from arctic_core.errors import RequestCancelled, ServerBusy
from arctic_core.protocol import Empty, GenerateRequest
from arctic_core.serving.call_gate import CallGate
from arctic_core.serving.http import create_app
from arctic_core.serving.server import ArcticServer
from arctic_core.transports.inprocess import InProcessTransport
from helpers import LiveServer, random_grpo_batch

GRPO = [{"name": "pg"}]


def calls(count: int = 32) -> list[tuple[list[list[int]], dict]]:
    """``count`` generate calls of different prompts, lengths and settings, each seeded."""
    gen = torch.Generator().manual_seed(0)
    settings = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.1),
                dict(temperature=0.9, repetition_penalty=1.3)]
    out = []
    for i in range(count):
        prompts = [torch.randint(3, 60, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(1 + i % 2)]
        params = dict(n=1 + i % 3, max_tokens=6 + i % 7, ignore_eos=True, seed=100 + i, **settings[i % len(settings)])
        out.append((prompts, params))
    return out


def decode_steps(server: ArcticServer) -> int:
    return server.sampler.engine.stats.decode_steps


def answers(results) -> list[tuple[list[list[int]], list[list[float]]]]:
    """Each call's response tokens and log-probs, row by row."""
    out = []
    for result in results:
        batch = result.batch
        lens = batch.response_lens.tolist()
        out.append(([batch.response_ids[i, :n].tolist() for i, n in enumerate(lens)],
                    [batch.sampling_logprobs[i, :n].tolist() for i, n in enumerate(lens)]))
    return out


def assert_same_answers(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens  # the same random numbers alone or in any batch
        for row, want_row in zip(logprobs, want_logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(row), torch.tensor(want_row), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def server(tiny_policy):
    server = ArcticServer(ArcticConfig.from_dict({
        "model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0, "trainer": {"backend": "torch"},
        "server": {"max_generate_calls": 40}}))
    yield server
    server.handle("shutdown", Empty())


@pytest.fixture(scope="module")
def alone(server):
    """The 32 calls one after another: their answers and the decode steps they took."""
    client = ArcticClient(InProcessTransport(server))
    before = decode_steps(server)
    results = [client.generate(prompts, **params) for prompts, params in calls()]
    return answers(results), decode_steps(server) - before


def test_concurrent_calls_from_threads_share_the_engines_steps_and_draw_as_alone(server, alone):
    want, steps_alone = alone
    client = ArcticClient(InProcessTransport(server))
    before = decode_steps(server)
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda call: client.generate(call[0], **call[1]), calls()))
    steps = decode_steps(server) - before
    assert_same_answers(answers(results), want)
    assert steps < steps_alone / 3, (steps, steps_alone)  # shared steps, not one call after another
    assert server.sampler.engine.stats.most_running >= 16


def test_concurrent_calls_over_http_share_the_engines_steps_and_draw_as_alone(server, alone):
    want, steps_alone = alone
    live = LiveServer(create_app(server))
    try:
        async def all_at_once():
            client = AsyncArcticClient.http(live.url)
            try:
                return await asyncio.gather(*(client.generate(p, **params) for p, params in calls()))
            finally:
                await client.aclose()

        before = decode_steps(server)
        results = asyncio.run(all_at_once())
        steps = decode_steps(server) - before
    finally:
        live.stop()
    assert_same_answers(answers(results), want)
    assert steps < steps_alone / 3, (steps, steps_alone)


def test_training_runs_beside_generation_and_each_token_carries_its_policy_version(server):
    client = ArcticClient(InProcessTransport(server))
    engine = server.sampler.engine
    version = client.status().policy_version
    batch = random_grpo_batch(vocab=60)
    started = engine.stats.generated_tokens
    with ThreadPoolExecutor(1) as pool:
        rollout = pool.submit(client.generate, [[5, 6, 7], [8, 9]], n=2, max_tokens=400, ignore_eos=True, seed=3)
        while engine.stats.generated_tokens < started + 20:  # the samples are under way
            time.sleep(0.01)
        trained = client.fwd_bwd(batch, GRPO)
        client.step()
        synced = client.sync_weights()
        assert not rollout.done(), "the rollout should still run: make it longer"
        result = rollout.result()
    assert trained.metrics["waited_seconds"] < 1.0  # did not wait for the rollout
    assert synced.policy_version == version + 1
    got = result.batch
    oldest, newest = got.version_range()
    assert oldest.tolist() == [version] * 4 and newest.tolist() == [version + 1] * 4
    assert got.policy_version.tolist() == [version] * 4  # a sample's version: its oldest token's
    for row, length in enumerate(got.response_lens.tolist()):
        versions = got.token_policy_version[row, :length].tolist()
        assert versions == sorted(versions)  # old tokens first, then the new weights' to the end
        assert 0 < versions.count(version) < length


def test_a_checkpoint_waits_for_the_calls_in_flight_and_calls_after_it_wait_for_it(server, tmp_path):
    client = ArcticClient(InProcessTransport(server))
    engine = server.sampler.engine
    started = engine.stats.generated_tokens
    with ThreadPoolExecutor(2) as pool:
        rollout = pool.submit(client.generate, [[5, 6, 7]], n=2, max_tokens=300, ignore_eos=True)
        while engine.stats.generated_tokens < started + 10:
            time.sleep(0.01)
        saving = pool.submit(client.save_checkpoint, tmp_path / "ckpt")
        while server.gate.waiting["alone"] == 0:
            time.sleep(0.01)
        assert server.load()["calls"]["generate"] == 1 and not saving.done()
        rollout_done = rollout.result()
        saved = saving.result()
    assert rollout_done.batch.response_lens.tolist() == [300, 300]
    assert saved.metrics["waited_seconds"] > 0.0


def test_calls_for_one_prompt_while_it_waits_share_its_prefill_and_draw_as_alone(server):
    # A GRPO group sent as separate calls (seeded, as TRL and verl's workers do).
    engine = server.sampler.engine
    prompt = list(range(3, 43))  # 40 tokens: two full blocks and a part
    params = [SamplingParams(n=1 + i % 2, temperature=1.0, max_tokens=6, ignore_eos=True, seed=7 + i)
              for i in range(6)]
    before = engine.stats.prefill_tokens
    with engine._between_steps():  # the loop waits: every call arrives before its next step
        requests = [engine.submit([prompt], p) for p in params]
    answers = [[o.tokens for o in r.wait(timeout=60)] for r in requests]
    assert engine.stats.prefill_tokens - before == len(prompt)  # computed once for the 9 samples
    assert [len(a) for a in answers] == [p.n for p in params]
    assert len({tuple(t) for a in answers for t in a}) > 1  # each call its own random numbers
    assert any(a[0] != a[1] for a in answers if len(a) == 2)  # and each sample of a call its own
    for p, got in zip(params, answers, strict=True):
        assert [o.tokens for o in engine.generate([prompt], p)] == got  # as the call alone draws them


def test_a_cancelled_request_leaves_the_batch_and_gives_its_blocks_back(server):
    engine = server.sampler.engine
    request = engine.submit([[5, 6, 7, 8]], SamplingParams(n=4, max_tokens=500, ignore_eos=True))
    while engine.load()["running"] < 4:
        time.sleep(0.01)
    assert engine.load()["kv_used_blocks"] > 0
    engine.cancel(request)
    with pytest.raises(RequestCancelled):
        request.wait(timeout=30)
    counted = {"preempted": 0, "decode_steps": 0}  # counts since the start, not of the moment
    assert engine.load() | counted == {"running": 0, "waiting": 0, "requests": 0, **counted,
                                       "kv_used_blocks": 0, "kv_blocks": engine.pool.capacity}


def test_an_http_client_that_disconnects_cancels_its_generate_call(server):
    engine = server.sampler.engine
    live = LiveServer(create_app(server))
    try:
        body = wire.encode_request("generate", GenerateRequest(
            prompts=[[5, 6, 7 + i] for i in range(8)], params=SamplingParams(n=8, max_tokens=500, ignore_eos=True)))
        before = engine.stats.generated_tokens
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(f"{live.url}/v1/generate", content=body, timeout=httpx.Timeout(1.0),
                       headers={"Content-Type": wire.CONTENT_TYPE})
        deadline = time.monotonic() + 60
        while engine.load()["requests"] or engine.load()["kv_used_blocks"]:
            assert time.monotonic() < deadline, engine.load()
            time.sleep(0.05)
        assert engine.stats.generated_tokens - before < 64 * 500 / 2  # stopped, not run to its end
        # The engine serves the next call.
        client = ArcticClient.http(live.url)
        assert client.generate([[5, 6]], n=2, max_tokens=3).batch.num_responses == 2
        client.close()
    finally:
        live.stop()


def test_a_full_server_answers_429_and_the_client_retries_until_a_call_ends(server):
    live = LiveServer(create_app(server))
    limit = server.config.server.max_generate_calls
    long = dict(n=1, max_tokens=300, ignore_eos=True)
    client = ArcticClient.http(live.url)
    try:
        with ThreadPoolExecutor(limit + 1) as pool:
            running = [pool.submit(client.generate, [[5, 6, 7]], **long) for _ in range(limit)]
            while server.load()["generate_calls"] < limit:
                time.sleep(0.01)
            body = wire.encode_request("generate", GenerateRequest(prompts=[[5]], params=SamplingParams(max_tokens=2)))
            refused = httpx.post(f"{live.url}/v1/generate", content=body, headers={"Content-Type": wire.CONTENT_TYPE})
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"] == "ServerBusy"
            with pytest.raises(ServerBusy, match="max_generate_calls"):  # waiting is bounded by the timeout
                ArcticClient.http(live.url, timeout=0.5).generate([[5]], max_tokens=2)
            retried = pool.submit(client.generate, [[5]], max_tokens=2)  # waits out the 429s
            assert retried.result().batch.num_responses == 1
            assert all(r.result().batch.response_lens.tolist() == [300] for r in running)
    finally:
        client.close()
        live.stop()


def test_an_engine_no_one_holds_is_freed_once_its_loop_is_idle(tiny_policy):
    import gc
    import weakref

    from arctic_core.hf import load_causal_lm
    from arctic_fca.engine import EmbeddedEngine, EngineOptions
    from arctic_fca.engine import engine as engine_module

    model = load_causal_lm(ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}}).model)
    engine = EmbeddedEngine(model, EngineOptions(kv_cache_tokens=1024))
    assert len(engine.generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=3))) == 2
    alive = weakref.ref(engine)
    del engine
    deadline = time.monotonic() + engine_module.IDLE_EXIT_S + 10
    while alive() is not None:  # its loop's thread ends when idle, and the cache goes with the engine
        assert time.monotonic() < deadline, "the idle engine is still held"
        time.sleep(0.1)
        gc.collect()


# ----------------------------------------------------------------- the gate alone
def occupancy(gate: CallGate, ops: list[str], hold: float = 0.05) -> list[tuple[str, float, float]]:
    """Run ``ops`` on threads through ``gate`` (each holds it ``hold`` s): (op, start, end) of each."""
    spans, lock = [], threading.Lock()

    def run(op):
        with gate.enter(op):
            begin = time.monotonic()
            time.sleep(hold)
            with lock:
                spans.append((op, begin, time.monotonic()))

    threads = [threading.Thread(target=run, args=(op,)) for op in ops]
    for thread in threads:
        thread.start()
        time.sleep(0.005)  # arrival order
    for thread in threads:
        thread.join()
    return spans


def overlap(a, b) -> bool:
    return a[1] < b[2] and b[1] < a[2]


@pytest.mark.parametrize("colocate", [False, True])
def test_the_gate_runs_generation_together_training_one_at_a_time_and_lifecycle_alone(colocate):
    spans = occupancy(CallGate(colocate), ["generate", "generate", "fwd_bwd", "step", "generate", "sleep",
                                           "generate", "status"])
    by_op = lambda op: [s for s in spans if s[0] == op]  # noqa: E731
    pairs = [(a, b) for i, a in enumerate(spans) for b in spans[i + 1:] if overlap(a, b)]
    kinds = {frozenset((a[0], b[0])) for a, b in pairs}
    assert frozenset(("generate",)) in kinds  # generate calls side by side
    assert frozenset(("fwd_bwd", "step")) not in kinds  # training one at a time
    assert not [p for p in pairs if "sleep" in (p[0][0], p[1][0]) and "status" not in (p[0][0], p[1][0])]
    mixed = any({a[0], b[0]} & {"fwd_bwd", "step"} and {a[0], b[0]} & {"generate"} for a, b in pairs)
    assert mixed != colocate  # training beside generation unless the engines take turns on one device
    assert len(by_op("status")) == 1

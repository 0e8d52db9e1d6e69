"""The HTTP server and transport against a real uvicorn server on loopback (never another host).

Same results as in process, the async client, bad input answered 4xx with the cause, a bounded
load test, /metrics and /openapi.json, and the ``arctic-rl serve`` command itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from arctic_core.adapters import lost_server as lost_server_module
from arctic_core.adapters.lost_server import lost_server
from arctic_core.adapters.settings import BackendSettings
from arctic_core import wire
from arctic_core.batch import RolloutBatch
from arctic_core.cli import app as cli_app, bind_port
from arctic_core.client import ArcticClient, AsyncArcticClient
from arctic_core.config import ArcticConfig
from arctic_core.errors import ArcticError, BatchError, ConfigError, PluginNotFoundError, RequestError
from arctic_core.serving.http import create_app
from arctic_core.transports.http import wait_until_serving
from arctic_core.protocol import OPS, GenerateRequest
from arctic_core.serving.server import ArcticServer
from arctic_core.errors import RemoteError
from helpers import HOST, LiveServer, batch_tensors, wire_body

TOKEN = "s3cret-token"
PROMPTS = [[1, 20, 30, 40, 2], [1, 50, 60, 2], [1, 70, 2]]
# Wall-clock and memory readings: the only values allowed to differ between transports.
TIMING = ("seconds", "waited_seconds", "tokens_per_s", "peak_rss_gib", "cuda_peak_gib")


@pytest.fixture(scope="module")
def config(tiny_policy: Path) -> ArcticConfig:
    return ArcticConfig.from_dict(
        {"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0, "trainer": {"backend": "torch"},
         "reference": {"backend": "torch"}}
    )


@pytest.fixture(scope="module")
def shared(config: ArcticConfig) -> Iterator[tuple[ArcticServer, LiveServer]]:
    """One server for the tests that do not need a fresh model, no token."""
    server = ArcticServer(config)
    live = LiveServer(create_app(server))
    yield server, live
    live.stop()


@pytest.fixture(scope="module")
def guarded(shared) -> Iterator[LiveServer]:
    """The same model behind a second app with a token and a 64 KiB body limit."""
    live = LiveServer(create_app(shared[0], token=TOKEN, max_body_bytes=64 * 1024))
    yield live
    live.stop()


# ----------------------------------------------------------------- (a) same results as in process
def grpo_loop(client: ArcticClient, steps: int = 2) -> list[dict]:
    """The demo's GRPO step (generate, log-probs, reference log-probs, ppo + kl, step, sync)."""
    record = []
    for step in range(steps):
        gen = client.generate(PROMPTS, n=3, max_tokens=6, seed=100 + step)
        batch = gen.batch
        rewards = (batch.response_ids % 2 == 0).float().sum(1) / batch.response_lens.clamp(min=1)
        old = client.log_probs(batch, processors=["logprobs", "entropy"])
        ref = client.log_probs(batch, model="reference").outputs["logprobs"]
        adv = torch.zeros_like(rewards)
        for rows in batch.groups():
            adv[rows] = rewards[rows] - rewards[rows].mean()
        batch = batch.replace(old_logprobs=old.outputs["logprobs"], ref_logprobs=ref, rewards=rewards, advantages=adv)
        train = client.fwd_bwd(batch, [{"name": "ppo", "clip_low": 0.2, "clip_high": 0.28},
                                       {"name": "kl", "weight": 0.1}])
        opt = client.step()
        sync = client.sync_weights()
        record.append({
            "batch": gen.batch.to_tensors(), "outputs": old.outputs, "ref": ref, "policy_version": sync.policy_version,
            "metrics": [{k: v for k, v in r.metrics.items() if k not in TIMING} for r in (gen, old, train, opt, sync)],
        })
    return record


def test_grpo_over_http_equals_in_process(config):
    in_process = ArcticClient.in_process(config)
    expected = grpo_loop(in_process)
    in_process.shutdown()
    live = LiveServer(create_app(ArcticServer(config)))
    try:
        with ArcticClient.http(live.url) as client:
            got = grpo_loop(client)
    finally:
        live.stop()
    assert_same_loop(expected, got)


def assert_same_loop(expected: list[dict], got: list[dict]) -> None:
    assert expected[-1]["metrics"][2]["loss"] != 0 and expected[-1]["policy_version"] == 2
    for want, have in zip(expected, got, strict=True):
        assert want["metrics"] == have["metrics"]  # exact: the same computation, only the bytes moved
        assert want["policy_version"] == have["policy_version"]
        assert torch.equal(want["ref"], have["ref"])
        for key in ("batch", "outputs"):
            assert want[key].keys() == have[key].keys()
            for name in want[key]:
                assert want[key][name].dtype == have[key][name].dtype, name
                assert torch.equal(want[key][name], have[key][name]), name


# ----------------------------------------------------------------- (b) the async client
def test_async_client_gathers_concurrent_calls(shared):
    server, live = shared
    with ArcticClient.http(live.url) as sync_client:
        expected = [sync_client.generate(PROMPTS, n=2, max_tokens=3, seed=s).batch for s in range(5)]

    async def main():
        client = AsyncArcticClient.http(live.url)
        try:
            results = await asyncio.gather(*(client.generate(PROMPTS, n=2, max_tokens=3, seed=s) for s in range(5)))
            status, logps = await asyncio.gather(client.status(), client.log_probs(results[0].batch))
            return results, status, logps
        finally:
            await client.aclose()

    results, status, logps = asyncio.run(main())
    for want, got in zip(expected, results, strict=True):
        assert torch.equal(want.response_ids, got.batch.response_ids)
    assert status.policy_version == server.policy_version
    assert logps.outputs["logprobs"].shape == results[0].batch.response_ids.shape


# ----------------------------------------------------------------- (c) bad input
def post(live: LiveServer, op: str, body: bytes, token: str | None = TOKEN, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{live.url}/v1/{op}", content=body, headers=headers, timeout=30, **kwargs)


def assert_refused(response: httpx.Response, status: int, error: str, match: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] == error and match in body["message"], body


def test_bad_input_gets_a_4xx_naming_the_problem_and_the_server_keeps_serving(guarded):
    valid = wire.encode(GenerateRequest(prompts=[[1, 2]], params={"max_tokens": 2}))
    ppo = {"loss": [{"name": "ppo"}]}
    assert_refused(post(guarded, "generate", b"\x00" * 3), 400, "RequestError", "truncated body: 3 bytes")
    assert_refused(post(guarded, "generate", b"\xff" * 100), 400, "RequestError", "not a safetensors message")
    assert_refused(post(guarded, "generate", valid[: len(valid) // 2]), 400, "RequestError", "truncated body")
    assert_refused(post(guarded, "fwd_bwd", wire_body(batch_tensors(), ppo, "FwdBwdRequest")[:-3]), 400, "RequestError",
                   "malformed or truncated")
    assert_refused(post(guarded, "fwd_bwd", valid), 400, "RequestError",
                   "holds a 'GenerateRequest' message but this operation takes a FwdBwdRequest")
    wrong_dtype = wire_body(batch_tensors(response_ids=torch.ones(1, 2)), ppo, "FwdBwdRequest")
    assert_refused(post(guarded, "fwd_bwd", wrong_dtype), 400, "BatchError", "response_ids must hold integers")
    assert_refused(post(guarded, "fwd_bwd", wire_body(batch_tensors(), {}, "FwdBwdRequest")), 400, "RequestError",
                   "loss: Field required")
    no_index = {k: v for k, v in batch_tensors().items() if k != "batch.prompt_index"}
    assert_refused(post(guarded, "fwd_bwd", wire_body(no_index, ppo, "FwdBwdRequest")), 400, "BatchError",
                   "missing required batch field(s) ['prompt_index']")
    assert_refused(post(guarded, "train", valid), 404, "RequestError", "unknown operation 'train'")
    unknown_loss = wire_body(batch_tensors(advantages=torch.ones(1)), {"loss": [{"name": "pp0"}]}, "FwdBwdRequest")
    assert_refused(post(guarded, "fwd_bwd", unknown_loss), 400, "PluginNotFoundError", "no loss named 'pp0'")
    # Too big: refused on Content-Length before reading, and on the bytes read when no length is sent.
    assert_refused(post(guarded, "generate", b"\x00" * 100_000), 413, "PayloadTooLarge",
                   "exceeds the server's limit of 65536 bytes")
    chunked = httpx.post(f"{guarded.url}/v1/generate", content=iter([b"\x00" * 40_000] * 3),
                         headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert_refused(chunked, 413, "PayloadTooLarge", "exceeds the server's limit")
    # Tokens: missing or wrong -> 401, on the calls and on /metrics.
    assert_refused(post(guarded, "generate", valid, token=None), 401, "Unauthorized", "missing bearer token")
    assert_refused(post(guarded, "generate", valid, token="s3cret-tokem"), 401, "Unauthorized", "wrong bearer token")
    assert httpx.get(f"{guarded.url}/metrics").status_code == 401
    # Still serving.
    assert httpx.get(f"{guarded.url}/health").json()["status"] == "ok"
    assert post(guarded, "generate", valid).status_code == 200


def test_client_sees_the_same_error_classes_as_in_process(guarded):
    client = ArcticClient.http(guarded.url, token=TOKEN)
    batch = client.generate(PROMPTS, n=1, max_tokens=3, seed=1).batch.replace(advantages=torch.ones(3))
    with pytest.raises(PluginNotFoundError, match="no loss named 'pp0'.*ppo"):
        client.fwd_bwd(batch, "pp0")
    with pytest.raises(RequestError, match="token id 100000 >= vocab size"):
        client.generate([[1, 100000]], n=1)
    with pytest.raises(BatchError, match="old_logprobs"):
        client.fwd_bwd(batch, "ppo")
    with pytest.raises(RequestError, match="unknown operation 'train'"):
        client.transport.call("train", None)
    with pytest.raises(RemoteError, match="PayloadTooLarge.*413") as info:
        client.log_probs(RolloutBatch.from_lists([[1]], [[2] * 10_000], [0]))
    assert info.value.status == 413
    with pytest.raises(RemoteError, match="Unauthorized.*401.*wrong bearer token"):
        ArcticClient.http(guarded.url, token="nope").status()
    assert client.generate(PROMPTS, n=1, max_tokens=2).batch.num_responses == 3
    client.close()


def test_an_unexpected_failure_is_a_500_and_the_server_keeps_serving(shared, monkeypatch):
    server, live = shared

    def broken(*args, **kwargs):
        raise RuntimeError("the sampler fell over")

    client = ArcticClient.http(live.url)
    monkeypatch.setattr(server.sampler, "submit", broken)  # how the server reaches the embedded sampler
    with pytest.raises(RemoteError,
                       match="RuntimeError.*500.*generate failed on the server: the sampler fell over") as info:
        client.generate(PROMPTS, n=1, max_tokens=2)
    assert info.value.status == 500
    monkeypatch.undo()
    assert client.generate(PROMPTS, n=1, max_tokens=2).batch.num_responses == 3
    client.close()


def test_a_failure_inside_a_checkpointed_backward_leaves_every_server_thread_working(shared, monkeypatch):
    # torch's checkpoint keeps its saved-tensor hooks open in a generator that the failed call's
    # traceback holds; closed on another thread, it left them on the pool thread that ran the call,
    # and every later fwd_bwd on that thread failed.
    import arctic_zorro.packed_forward as packed_forward

    server, live = shared
    client = ArcticClient.http(live.url)
    batch = client.generate(PROMPTS, n=2, max_tokens=3, seed=3).batch
    batch = batch.replace(old_logprobs=client.log_probs(batch).outputs["logprobs"], advantages=torch.ones(6))

    def failing(*args, **kwargs):
        raise RuntimeError("a processor fell over")

    monkeypatch.setattr(packed_forward, "run_processors", failing)
    with pytest.raises(RemoteError, match="a processor fell over"):
        client.fwd_bwd(batch, "ppo")
    monkeypatch.undo()
    # The HTTP server runs calls on a pool of threads: reach the one that failed. Same batch, same
    # weights (no step between): the same loss every time.
    losses = [client.fwd_bwd(batch, "ppo").metrics["loss"] for _ in range(8)]
    assert losses == [losses[0]] * 8
    client.step()
    client.close()


def unused_port() -> int:
    sock = socket.socket()
    sock.bind((HOST, 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    return port


def test_refused_without_a_reachable_server():
    port = unused_port()
    with pytest.raises(RemoteError, match=f"status to the Arctic server at http://{HOST}:{port} failed"):
        ArcticClient.http(f"http://{HOST}:{port}", timeout=5).status()


def test_waiting_for_a_server_that_never_answers_raises_a_remote_error():
    url = f"http://{HOST}:{unused_port()}"
    with pytest.raises(RemoteError, match=f"Timeout .*{url} did not answer /health within 0.5 s") as info:
        wait_until_serving(url, timeout=0.5)
    assert info.value.status is None
    with pytest.raises(RemoteError, match=f"ServerExited .*{url} ended before it answered /health"):
        wait_until_serving(url, timeout=60, alive=lambda: False)


def test_a_server_is_lost_only_when_no_connection_can_be_made(guarded, monkeypatch):
    """What the adapters ask when a run fails: a server that answers, even to refuse the token, or
    that takes a connection and is slow to answer (busy with the failed run's last call) is there."""
    monkeypatch.setattr(lost_server_module, "PROBE_TIMEOUT_S", 0.5)
    assert lost_server(BackendSettings(url=guarded.url, token=TOKEN)) is None
    assert lost_server(BackendSettings(url=guarded.url, token="wrong-token")) is None
    assert lost_server(BackendSettings()) is None  # a backend the adapter started: no URL to ask
    with socket.socket() as busy:  # connections wait in its backlog, never answered
        busy.bind((HOST, 0))
        busy.listen(8)
        assert lost_server(BackendSettings(url=f"http://{HOST}:{busy.getsockname()[1]}")) is None
    assert lost_server(BackendSettings(url=f"http://{HOST}:{unused_port()}")).startswith("ConnectError: ")


def test_a_url_without_a_scheme_or_a_bad_timeout_is_refused_at_once_and_none_waits_without_limit(shared):
    for url in (f"{HOST}:8000", f"htp://{HOST}:8000", "http:///v1"):
        with pytest.raises(ConfigError, match="must start with http:// or https:// and name a host"):
            wait_until_serving(url, timeout=60)  # it retried for the whole timeout
        with pytest.raises(ConfigError, match="must start with http:// or https://"):
            ArcticClient.http(url)
    with pytest.raises(ConfigError, match="timeout must be a positive number of seconds or None"):
        ArcticClient.http(f"http://{HOST}:8000", timeout=0)
    _, live = shared
    with ArcticClient.http(live.url + "/", timeout=None) as client:  # httpx's "no limit"
        assert client.status().policy_version >= 0


def test_a_call_that_times_out_says_it_may_still_run_on_the_server():
    """The request went out and no answer came in time: the server may still be running it."""
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind((HOST, 0))
        silent.listen()
        url = f"http://{HOST}:{silent.getsockname()[1]}"
        with ArcticClient.http(url, timeout=0.5) as client, pytest.raises(RemoteError) as info:
            client.generate([[1, 2]], max_tokens=2)
    assert info.value.status is None and "ReadTimeout" in str(info.value)
    assert "the call may still run on the server: check status() before repeating it" in str(info.value)


def raw_body(header: str) -> bytes:
    """A safetensors-shaped body: the 8-byte length, then ``header`` as its JSON header."""
    data = header.encode()
    return len(data).to_bytes(8, "little") + data


def test_deeply_nested_json_in_a_body_is_a_400_and_the_server_keeps_serving(shared):
    _, live = shared
    deep = "[" * 100_000 + "]" * 100_000  # far past the recursion limit of Python's JSON parser
    bodies = {
        "the safetensors header": raw_body(deep),
        "the 'arctic' metadata of the GenerateRequest": raw_body(json.dumps(
            {"__metadata__": {wire.JSON_KEY: deep, wire.MESSAGE_KEY: "GenerateRequest"}})),
    }
    for what, body in bodies.items():
        assert_refused(post(live, "generate", body, token=None), 400, "RequestError",
                       f"malformed body: {what} nests JSON")
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"


def test_a_request_that_reaches_no_endpoint_gets_the_error_format(shared):
    _, live = shared
    for method, path, status, error, match in [
        ("GET", "/v1/generate", 405, "MethodNotAllowed", "GET /v1/generate: this path takes POST"),
        ("PUT", "/v1/status", 405, "MethodNotAllowed", "PUT /v1/status: this path takes POST"),
        ("POST", "/v1/", 404, "NotFound", "POST /v1/: no such endpoint; the server answers POST /v1/<operation> ("),
        ("POST", "/v1/x/y", 404, "NotFound", "POST /v1/x/y: no such endpoint"),
    ]:
        response = httpx.request(method, f"{live.url}{path}", timeout=30)
        assert_refused(response, status, error, match)
        assert response.headers.get("allow") == ("POST" if status == 405 else None)


def test_a_token_no_http_header_can_carry_is_refused_by_server_and_client(shared, monkeypatch):
    server, live = shared
    for token in ("pässwörd", " padded", "tab\there"):
        with pytest.raises(ConfigError, match=r"bearer token \(ARCTIC_RL_TOKEN\) must be printable ASCII"):
            create_app(server, token=token)
        with pytest.raises(ConfigError, match=r"bearer token \(the token argument\) must be printable ASCII"):
            ArcticClient.http(live.url, token=token)
    monkeypatch.setenv("ARCTIC_RL_TOKEN", "pässwörd")
    with pytest.raises(ConfigError, match=r"bearer token \(ARCTIC_RL_TOKEN\) must be printable ASCII"):
        AsyncArcticClient.http(live.url)
    # Inner spaces travel as they are.
    spaced = LiveServer(create_app(server, token="two words"))
    try:
        with ArcticClient.http(spaced.url, token="two words") as client:
            assert client.status().step == server.step_count
    finally:
        spaced.stop()


def test_after_shutdown_health_says_so_for_every_engine(config):
    answered = threading.Event()
    live = LiveServer(create_app(ArcticServer(config), on_shutdown=answered.set))
    try:
        with ArcticClient.http(live.url) as client:
            client.status()
            assert not answered.is_set()
            client.shutdown()
            assert answered.wait(10)  # run once the answer was sent: `arctic-rl serve` exits there
            with pytest.raises(RequestError, match="the server has been shut down"):
                client.status()
        health = httpx.get(f"{live.url}/health").json()
    finally:
        live.stop()
    assert health["status"] == "shut down" and health["engines"].keys() == {"trainer", "sampler", "reference"}
    assert all(engine["asleep"] for engine in health["engines"].values()), health


# ----------------------------------------------------------------- (d) bounded load
def load_prompt(i: int) -> list[int]:
    return [5 + i // 50, 5 + i % 50, 60]  # distinct per call for i < 2500 (vocab 288)


@pytest.mark.timeout(120)
def test_hundreds_of_concurrent_generate_calls_lose_and_duplicate_nothing(shared):
    server, live = shared
    calls = 300

    async def main():
        client = AsyncArcticClient.http(live.url, timeout=60)
        health_seconds: list[float] = []
        in_flight: list[int] = []  # generate calls running when each probe was answered

        async def probe():  # the event loop keeps answering while calls queue behind the model
            async with httpx.AsyncClient(base_url=live.url) as http:
                for _ in range(3):
                    await asyncio.sleep(0.2)
                    start = time.perf_counter()
                    answer = await http.get("/health", timeout=10)
                    assert answer.status_code == 200
                    health_seconds.append(time.perf_counter() - start)
                    in_flight.append(answer.json()["calls"]["generate"])

        try:
            calls_ = [client.generate([load_prompt(i)], n=1, max_tokens=1, seed=i) for i in range(calls)]
            results, _ = await asyncio.gather(asyncio.gather(*calls_), probe())
            return results, health_seconds, in_flight
        finally:
            await client.aclose()

    start = time.perf_counter()
    results, health_seconds, in_flight = asyncio.run(main())
    assert time.perf_counter() - start < 100
    assert len(results) == calls
    assert [r.batch.prompt(0) for r in results] == [load_prompt(i) for i in range(calls)]  # none lost, none swapped
    assert all(r.batch.num_responses == 1 and int(r.batch.response_lens[0]) == 1 for r in results)
    # Answered in the middle of the calls, not after them (a loop blocked behind the model would
    # answer once they are done); the bound only catches a loop that stalls for long.
    assert max(in_flight) > 0 and max(health_seconds) < 10.0, (in_flight, health_seconds)
    # A few results against the same call made alone: concurrency changed nothing.
    with ArcticClient.http(live.url) as client:
        for i in (0, 137, calls - 1):
            alone = client.generate([load_prompt(i)], n=1, max_tokens=1, seed=i).batch
            assert torch.equal(alone.response_ids, results[i].batch.response_ids)


@pytest.mark.timeout(180)
def test_256_mixed_calls_from_64_clients_are_all_answered_and_counted(shared):
    """64 clients, each with its own connections, send 4 calls at once: generate, log_probs and
    status, some of them invalid. Each gets its result or a clean error; /metrics counts all 256."""
    server, live = shared
    batch = ArcticClient.http(live.url).generate(PROMPTS, n=2, max_tokens=4, seed=3).batch
    plan = [(c, k) for c in range(64) for k in range(4)]

    def kind(c: int, k: int) -> str:
        return ["generate", "log_probs", "status", "bad_generate"][(c + k) % 4]

    async def one(client, c: int, k: int):
        call = kind(c, k)
        try:
            if call == "generate":
                return await client.generate([load_prompt(4 * c + k)], n=2, max_tokens=2, seed=c)
            if call == "log_probs":
                return await client.log_probs(batch)
            if call == "status":
                return await client.status()
            return await client.generate([[1, 100_000 + c]], n=1)
        except RequestError as error:
            return error

    async def main():
        clients = [AsyncArcticClient.http(live.url, timeout=120) for _ in range(64)]
        try:
            return await asyncio.gather(*(one(clients[c], c, k) for c, k in plan))
        finally:
            await asyncio.gather(*(client.aclose() for client in clients))

    expected_logprobs = ArcticClient.http(live.url).log_probs(batch).outputs["logprobs"]
    before = counts(live.url)
    results = asyncio.run(main())
    for (c, k), result in zip(plan, results, strict=True):
        call = kind(c, k)
        if call == "bad_generate":
            assert isinstance(result, RequestError) and f"token id {100_000 + c} >= vocab size" in str(result)
        elif call == "generate":
            assert result.batch.prompt(0) == load_prompt(4 * c + k) and result.batch.num_responses == 2
        elif call == "log_probs":
            assert torch.equal(result.outputs["logprobs"], expected_logprobs)
        else:
            assert result.policy_version == server.policy_version
    after = counts(live.url)
    sent = {}
    for c, k in plan:
        key = ("generate", "RequestError") if kind(c, k) == "bad_generate" else (kind(c, k), "ok")
        sent[key] = sent.get(key, 0) + 1
    assert {key: after.get(key, 0) - before.get(key, 0) for key in sent} == sent
    assert sum(after.values()) - sum(before.values()) == 256
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"


def test_clients_that_disconnect_mid_request_leave_the_server_serving_others(shared):
    """A body cut off half-way is dropped (nothing runs; counted as ClientDisconnect); a call
    whose client leaves without reading the answer runs to its end. Others are served throughout."""
    server, live = shared
    host, port = live.url.removeprefix("http://").split(":")
    body = wire.encode(GenerateRequest(prompts=[[1, 2, 3]], params={"max_tokens": 4, "n": 2}))
    head = (f"POST /v1/generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: {wire.CONTENT_TYPE}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()

    def wait_for(key: tuple[str, str], more_than: float) -> None:
        deadline = time.monotonic() + 30
        while counts(live.url).get(key, 0) <= more_than:
            assert time.monotonic() < deadline, f"{key} was never counted"
            time.sleep(0.05)

    before = counts(live.url)
    with socket.create_connection((host, int(port))) as half:
        half.sendall(head + body[: len(body) // 2])
    wait_for(("generate", "ClientDisconnect"), before.get(("generate", "ClientDisconnect"), 0))
    with ArcticClient.http(live.url) as client:
        with socket.create_connection((host, int(port))) as unread:
            unread.sendall(head + body)
            assert client.generate(PROMPTS, n=1, max_tokens=2).batch.num_responses == 3  # served meanwhile
            wait_for(("generate", "ok"), before.get(("generate", "ok"), 0) + 1)  # ours and the unread one
        assert client.generate(PROMPTS, n=1, max_tokens=2).batch.num_responses == 3  # and afterwards
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"


# ----------------------------------------------------------------- (e) metrics, (f) openapi
def counts(url: str, headers: dict | None = None) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics", headers=headers).text
    return {
        (s.labels["op"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(text) if family.name == "arctic_calls"
        for s in family.samples if s.name == "arctic_calls_total"
    }


def test_metrics_count_calls_per_operation_and_outcome(shared):
    server, live = shared
    before = counts(live.url)
    with ArcticClient.http(live.url) as client:
        client.generate(PROMPTS, n=1, max_tokens=2)
        client.generate(PROMPTS, n=1, max_tokens=2)
        client.status()
        with pytest.raises(RequestError):
            client.generate([[1, 100000]], n=1)
    after = counts(live.url)
    assert after[("generate", "ok")] - before.get(("generate", "ok"), 0) == 2
    assert after[("status", "ok")] - before.get(("status", "ok"), 0) == 1
    assert after[("generate", "RequestError")] - before.get(("generate", "RequestError"), 0) == 1
    text = httpx.get(f"{live.url}/metrics").text
    for name in ("arctic_call_seconds_count", "arctic_tokens_total", "arctic_policy_version",
                 "process_resident_memory_bytes"):
        assert name in text, name
    # The embedded sampler's decode steps so far (the adapters' tests read them after a framework's run).
    assert f"arctic_sampler_decode_steps_total {float(server.sampler.engine.stats.decode_steps)}" in text


def test_openapi_lists_every_operation(shared):
    _, live = shared
    spec = httpx.get(f"{live.url}/openapi.json").json()
    for op in OPS:
        assert "post" in spec["paths"][f"/v1/{op}"], op
        assert wire.CONTENT_TYPE in spec["paths"][f"/v1/{op}"]["post"]["requestBody"]["content"]
    assert {"/health", "/metrics"} <= spec["paths"].keys()
    assert "Calls run side by side" in spec["info"]["description"]
    assert "one training call at a time" in spec["paths"]["/v1/step"]["post"]["summary"]


# ----------------------------------------------------------------- the serve command
def test_serve_refuses_a_public_host_without_a_token():
    result = CliRunner().invoke(cli_app, ["serve", "--host", "0.0.0.0"], env={"ARCTIC_RL_TOKEN": ""})
    assert result.exit_code != 0 and "without a token" in result.output


def test_serve_refuses_ray_options_without_ray():
    result = CliRunner().invoke(cli_app, ["serve", "--ray-workers", "4"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "take effect with --ray only" in result.output


def test_serve_on_a_taken_port_is_one_error_before_any_engine_starts(config, tmp_path):
    path = tmp_path / "arctic.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "arctic_core.cli", "serve", "--config", str(path), "--port", str(port)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: --port: cannot serve on {HOST}:{port}: Address "
                                                           "already in use")
    assert "serving on" not in proc.stderr and "deepspeed" not in proc.stderr.lower()


@pytest.mark.parametrize(("host", "message"), [
    ("no-such-host.invalid", "--host: 'no-such-host.invalid' is no address of this machine"),
    ("192.0.2.1", "--host: cannot serve on 192.0.2.1: Cannot assign requested address (not an address of this machine"),
])
def test_serve_on_a_host_that_is_not_this_machines_names_the_host(host, message):
    with pytest.raises(ArcticError) as info:
        bind_port(host, 0)
    assert str(info.value).startswith(message)


def serving_url(proc: subprocess.Popen, timeout: float = 90) -> str:
    """The URL ``serve`` announces on stderr (the bound port, also for --port 0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line, "serve ended before announcing its URL"
        if "Arctic RL serving on " in line:
            return line.split("Arctic RL serving on ")[1].split()[0]
    raise AssertionError("serve did not announce its URL")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_serve_command_answers_with_the_env_token_and_exits_after_shutdown(config, tmp_path):
    """On the port the OS picks (--port 0, announced), with the token from the environment; stdout
    stays empty (logs go to stderr); after a shutdown call the process ends and frees the port."""
    path = tmp_path / "arctic.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**os.environ, "ARCTIC_RL_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "arctic_core.cli", "serve", "--config", str(path), "--port", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = serving_url(proc)
        assert not url.endswith(":0")
        wait_until_serving(url, timeout=90, alive=lambda: proc.poll() is None)
        assert httpx.post(f"{url}/v1/status", content=b"").status_code == 401
        with ArcticClient.http(url, token=TOKEN) as client:
            assert client.generate(PROMPTS, n=2, max_tokens=2).batch.num_responses == 6
            client.shutdown()
        # The engines are gone: the process ends by itself and nothing listens on the port.
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr[-3000:]
        assert stdout == "" and '"POST /v1/generate HTTP/1.1" 200' in stderr  # the access log is a log
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        proc.terminate()
        proc.wait(timeout=30)

"""Per-sample rollout requests regrouped into prompt groups before they reach Arctic."""

from __future__ import annotations

import asyncio

from arctic_core.adapters.request_grouping import RequestGrouper
from arctic_core.client import AsyncArcticClient
from arctic_core.config import SamplingParams

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


def recording_sender(policy, calls: list[tuple[list[list[int]], int]]):
    """A grouper's ``send`` through an in-process backend, recording each call's prompts and n."""
    client = AsyncArcticClient.in_process({"model": {"path": str(policy), "device": "cpu"}, "seed": 0,
                                           "trainer": {"backend": "torch"}})

    async def send(prompts, params):
        calls.append((prompts, params.n))
        return (await client.generate(prompts, params)).batch

    return send


def test_per_sample_requests_become_one_generate_per_group_size(tiny_policy):
    """Eight samples of each of two prompts and two of a third, asked one at a time a few ms apart
    as an agent loop asks: two ``generate`` calls (n=8 with both prompts, n=2), every caller a
    sample of its prompt."""
    calls: list[tuple[list[list[int]], int]] = []

    async def run():
        send = recording_sender(tiny_policy, calls)
        grouper = RequestGrouper(send, quiet_s=0.05, max_wait_s=10.0)
        params = SamplingParams(n=1, max_tokens=4, temperature=1.0, seed=1)
        prompt_of = [index for index, count in {0: 8, 1: 8, 2: 2}.items() for _ in range(count)]

        async def ask(order: int, index: int):
            await asyncio.sleep(0.005 * order)
            return await grouper.submit(PROMPTS[index], params)

        return prompt_of, await asyncio.gather(*(ask(order, index) for order, index in enumerate(prompt_of)))

    prompt_of, answers = asyncio.run(run())
    assert sorted((n, sorted(map(tuple, prompts))) for prompts, n in calls) == [
        (2, [tuple(PROMPTS[2])]), (8, sorted([tuple(PROMPTS[0]), tuple(PROMPTS[1])]))]
    rows = set()
    for index, (batch, row) in zip(prompt_of, answers, strict=True):
        assert batch.prompt(row) == PROMPTS[index]  # the caller's own prompt
        rows.add((id(batch), row))
    assert len(rows) == len(answers)  # no sample handed out twice


def test_a_failed_generate_reaches_every_caller_of_the_group():
    async def run():
        async def send(prompts, params):
            raise RuntimeError("sampler down")

        grouper = RequestGrouper(send, quiet_s=0.01, max_wait_s=1.0)
        params = SamplingParams(n=1, max_tokens=4)
        return await asyncio.gather(*(grouper.submit(PROMPTS[0], params) for _ in range(3)), return_exceptions=True)

    assert [str(result) for result in asyncio.run(run())] == ["sampler down"] * 3


def test_requests_that_keep_coming_are_sent_after_the_longest_wait():
    sent: list[float] = []

    async def run():
        async def send(prompts, params):
            sent.append(asyncio.get_running_loop().time())
            raise RuntimeError("not needed")

        grouper = RequestGrouper(send, quiet_s=0.05, max_wait_s=0.1)

        async def ask(order: int):
            await asyncio.sleep(0.02 * order)  # never quiet for 50 ms
            return await grouper.submit(PROMPTS[0], SamplingParams(n=1))

        start = asyncio.get_running_loop().time()
        await asyncio.gather(*(ask(order) for order in range(15)), return_exceptions=True)
        return start

    start = asyncio.run(run())
    assert len(sent) >= 2 and sent[0] - start < 0.2  # the first gathering did not wait for the lull


def test_a_batch_is_sent_at_once_with_the_requests_already_waiting(tiny_policy):
    """A batched call (prompts repeated n times) goes out without waiting for a lull, grouped with
    the single requests that were waiting; each caller gets samples of its own prompts, in order."""
    calls: list[tuple[list[list[int]], int]] = []

    async def run():
        send = recording_sender(tiny_policy, calls)
        grouper = RequestGrouper(send, quiet_s=30.0, max_wait_s=60.0)  # only the batch can send these
        params = SamplingParams(n=1, max_tokens=4, seed=1)
        single = asyncio.ensure_future(grouper.submit(PROMPTS[2], params))
        await asyncio.sleep(0)
        batch = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1]]
        return batch, await asyncio.wait_for(grouper.submit_batch(batch, params), 30), await single

    batch, answers, single = asyncio.run(run())
    assert sorted((n, sorted(map(tuple, prompts))) for prompts, n in calls) == [
        (1, [tuple(PROMPTS[2])]), (2, sorted([tuple(PROMPTS[0]), tuple(PROMPTS[1])]))]
    assert [sample.prompt(row) for sample, row in answers] == batch
    assert single[0].prompt(single[1]) == PROMPTS[2]

"""A stand-in for vLLM 0.24's ``AsyncLLM`` with the parts the ``vllm`` sampler relies on: requests
join one running batch at the next step; outputs travel, as in vLLM, from the engine to an asyncio
queue, through an output handler into each request's collector (merged when the reader is behind),
and from there to ``generate``'s reader; ``pause_generation(mode="keep")`` returns once the step in
progress has sent its outputs; a closed ``generate`` aborts its request.

Its "model" draws token ``1000 * weights + 10 * sample index + position``, so a test can read from
each token which weights drew it and check the version the sampler reports for it.
"""

from __future__ import annotations

import asyncio
import sys
import types
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float


@dataclass
class Completion:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]


@dataclass
class Output:
    outputs: list[Completion]
    finished: bool

    def add(self, later: Output) -> None:  # vLLM's RequestOutput.add(aggregate=True)
        self.finished |= later.finished
        for new in later.outputs:
            old = next((c for c in self.outputs if c.index == new.index), None)
            if old is None:
                self.outputs.append(new)
            else:
                old.token_ids += new.token_ids
                old.logprobs += new.logprobs


class Collector:
    def __init__(self) -> None:
        self.output: Output | None = None
        self.ready = asyncio.Event()

    def put(self, output: Output) -> None:
        if self.output is None:
            self.output = output
            self.ready.set()
        else:
            self.output.add(output)

    async def get(self) -> Output:
        while self.output is None:
            await self.ready.wait()
        output, self.output = self.output, None
        self.ready.clear()
        return output


@dataclass
class Request:
    id: str
    prompt: list[int]
    n: int
    max_tokens: int
    drawn: list[int] = field(default_factory=list)  # tokens per sample so far

    def __post_init__(self) -> None:
        self.drawn = [0] * self.n


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float


@dataclass
class IterationStats:
    num_preempted_reqs: int = 0


class FakeAsyncLLM:
    BLOCKS = 100  # one block per running sample

    def __init__(self, args: Any, stat_loggers: list) -> None:
        self.args = args
        self.model_config = types.SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 1000)
        self.vllm_config = types.SimpleNamespace(cache_config=types.SimpleNamespace(num_gpu_blocks=self.BLOCKS))
        self.engine_core = types.SimpleNamespace(outputs_queue=asyncio.Queue())
        self.output_processor = types.SimpleNamespace(request_states={})
        self.stat_loggers = [factory(None, 0) for factory in stat_loggers]
        self.running: dict[str, Request] = {}
        self.weights, self.steps, self.paused, self.rpcs, self.aborted, self.requests = 0, 0, False, [], [], []
        self.resets: list[bool] = []
        self._idle = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._engine()), asyncio.ensure_future(self._output_handler())]

    @classmethod
    def from_engine_args(cls, args: Any, stat_loggers: list) -> FakeAsyncLLM:
        return cls(args, stat_loggers)

    async def _engine(self) -> None:
        """One token per running sample a step; a step's outputs go out together, as vLLM's do."""
        while True:
            await asyncio.sleep(0.001)
            if self.paused or not self.running:
                self._idle.set()
                continue
            self.steps += 1
            outputs = [(request.id, self._step(request)) for request in list(self.running.values())]
            self.engine_core.outputs_queue.put_nowait(outputs)
            for logger in self.stat_loggers:
                logger.record(SchedulerStats(sum(r.n for r in self.running.values()), 0,
                                             sum(r.n for r in self.running.values()) / self.BLOCKS), IterationStats())

    def _step(self, request: Request) -> Output:
        completions = []
        for index, drawn in enumerate(request.drawn):
            if drawn < request.max_tokens:
                token = 1000 * self.weights + 10 * index + drawn
                completions.append(Completion(index, [token], [{token: Logprob(-0.25 * (drawn + 1))}]))
                request.drawn[index] += 1
        finished = all(drawn == request.max_tokens for drawn in request.drawn)
        if finished:
            del self.running[request.id]
        return Output(completions, finished)

    async def _output_handler(self) -> None:
        """vLLM's handler, slow on purpose: an output may still be in transit when a pause returns."""
        while True:
            outputs = await self.engine_core.outputs_queue.get()
            for _ in range(3):
                await asyncio.sleep(0)
            for request_id, output in outputs:
                if (state := self.output_processor.request_states.get(request_id)) is not None:
                    state.queue.put(output)

    async def generate(self, prompt: dict, sampling: Any, request_id: str):
        self.requests.append(sampling)
        collector = Collector()
        self.output_processor.request_states[request_id] = types.SimpleNamespace(queue=collector)
        self.running[request_id] = Request(request_id, prompt["prompt_token_ids"], sampling.n, sampling.max_tokens)
        try:
            finished = False
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            self.running.pop(request_id, None)  # vLLM's abort: its blocks are free at once
            self.aborted.append(request_id)
            raise
        finally:
            self.output_processor.request_states.pop(request_id, None)

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        assert mode == "keep" and not clear_cache
        self._idle.clear()
        self.paused = True
        await self._idle.wait()  # the step in progress has put its outputs out

    async def resume_generation(self) -> None:
        self.paused = False

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        assert self.paused, "the cache is reset while vLLM is paused"
        self.resets.append(reset_running_requests)
        return True

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.rpcs.append(method)
        if method == "arctic_load_tensors":
            assert self.paused, "weights are loaded while vLLM is paused"
            self.weights = int(args[0]["version"].item())
        return [{"decode": 2}, {"decode": 3, "mixed": 1}] if method == "arctic_fca_stats" else [None]

    async def sleep(self, level: int) -> None:
        self.rpcs.append(f"sleep({level})")

    async def wake_up(self) -> None:
        self.rpcs.append("wake_up")

    def shutdown(self) -> None:
        for task in self._tasks:
            task.get_loop().call_soon_threadsafe(task.cancel)


def install(monkeypatch) -> types.SimpleNamespace:
    """``vllm`` (0.24.0) as the sampler imports it, with :class:`FakeAsyncLLM` as its engine."""
    kinds = types.SimpleNamespace(DELTA="delta")
    module = types.SimpleNamespace(
        __version__="0.24.0", AsyncLLMEngine=FakeAsyncLLM,
        AsyncEngineArgs=lambda **kwargs: types.SimpleNamespace(**kwargs),
        SamplingParams=lambda **kwargs: types.SimpleNamespace(**kwargs))
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", types.SimpleNamespace(RequestOutputKind=kinds))
    return module

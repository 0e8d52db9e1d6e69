"""Many generate calls in flight on one server: multi-turn agent episodes, and a GRPO rollout sent as
one call per sample against one call for the whole group.

    python3 bench/multi_turn.py                                # agent: 64 episodes x 4 turns, all in flight
    python3 bench/multi_turn.py --serial                       # the same calls, one in flight at a time
    python3 bench/multi_turn.py --tool-latency 0.5             # tool calls of 0.5 s on average between turns
    python3 bench/multi_turn.py --workload grpo-calls          # 8 prompts x 8 samples: 64 calls of n=1 vs one of n=8
    python3 bench/multi_turn.py --transport http               # through `arctic-rl serve` on 127.0.0.1
    python3 bench/multi_turn.py --baseline vllm [--fca]        # the same requests on vLLM 0.24's AsyncLLM
    python3 bench/multi_turn.py --sampler vllm [--fca]         # Arctic's server with its vllm sampling backend
    python3 bench/multi_turn.py --sync-every 2                 # the trainer's weights synced every 2 s meanwhile
    uv run python bench/multi_turn.py --smoke                  # tiny model on the CPU: both workloads, both transports

``agent``: each episode starts from a prompt of --prompt-len random tokens; each turn is one
``generate`` call (n=1) on the episode's whole history, whose answer joins the history followed by
a fixed "tool output" of --tool-tokens tokens (after a sleep of --tool-latency seconds on average,
the tool running). All episodes run at once on one event loop (``AsyncArcticClient``); --serial lets one
call be in flight at a time (a lock around each call; the tool sleeps still overlap), which is what
a server that runs calls one after another does anyway. Reported: generated tokens/s, seconds,
calls, each turn's latency (call to answer, queueing included), and in process the engine's step
counts. ``grpo-calls``: --prompts x --samples as separate n=1 calls, all in flight, then as one
call of n=--samples (on other prompts of the same length, so that neither finds the other's
prompts in the prefix cache); both times and their ratio.

Every sample is --max-tokens long (``ignore_eos``), so every mode and system generates the same
token count, and each answer is checked: one response per prompt and sample, each of that length.
The model: a shape of ``bench/shapes.py`` (random bf16 weights, made once under /tmp) or a model
folder. One untimed pass of the workload, shorter, comes first (kernels compiled, graphs captured).
``--baseline vllm`` runs the same requests (prompt ids, turns, tool tokens, lengths) on vLLM instead
of Arctic, one system per process, as ``bench/vllm_fca.py`` does; ``--sampler vllm`` runs them on
Arctic's server with vLLM as its sampling backend. ``--sync-every S`` syncs the trainer's weights into
the sampler every S seconds while the workload runs (samples then span policy versions: counted).
The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig

from arctic_core.client import AsyncArcticClient
from arctic_core.config import SamplingParams
from arctic_core.transports.http import wait_until_serving
from sampler import random_prompts
from shapes import QWEN3_1_7B, SMOKE_SHAPE, make_model

MODELS = {"qwen3-1.7b": QWEN3_1_7B, "tiny": SMOKE_SHAPE}
ENGINE_COUNTERS = ("decode_steps", "fca_steps", "prefill_steps", "prefill_tokens", "prefix_hit_tokens",
                   "prefill_seconds", "decode_seconds")
# A few seconds on two CPU cores per transport, server start aside.
SMOKE = dict(workload="agent", episodes=4, turns=3, tool_tokens=5, tool_latency=0.01, prompts=2, samples=4,
             prompt_len=24, max_tokens=6, serial=False, baseline=None, fca=False, sampler="embedded", sync_every=None)


# ----------------------------------------------------------------- the systems
class Arctic:
    """Arctic's async client, in process or over HTTP."""

    def __init__(self, client: AsyncArcticClient) -> None:
        self.client = client
        server = getattr(client.transport, "server", None)  # in process only: HTTP exposes no engine counters
        engine = getattr(getattr(server, "sampler", None), "engine", None)
        self.engine = engine if hasattr(engine, "stats") else None  # the embedded engine's step counts
        self.spanning = 0  # samples drawn by more than one policy version

    async def generate(self, prompts: list[list[int]], n: int, max_tokens: int) -> list[list[int]]:
        batch = (await self.client.generate(prompts, SamplingParams(n=n, max_tokens=max_tokens,
                                                                    ignore_eos=True))).batch
        assert batch.prompt_index.tolist() == [p for p in range(len(prompts)) for _ in range(n)], "not prompt-major"
        low, high = batch.version_range()
        self.spanning += int((high > low).sum())
        return [batch.response(i) for i in range(batch.num_responses)]


class Vllm:
    """vLLM 0.24's ``AsyncLLM`` on the same folder; ``fca``: our FCA attention backend, set up as
    ``VllmSampler`` sets it up for ``bench/vllm_fca.py``."""

    engine = None  # no step counts from vLLM's engine-core process

    def __init__(self, folder: str, max_model_len: int, fca: bool) -> None:
        from arctic_core.errors import ConfigError
        from arctic_fca.vllm.plugin import BASE_ENV
        from arctic_fca.vllm.sampler import WORKER_EXTENSION, import_vllm

        try:
            self.vllm = import_vllm()
        except ConfigError as exc:
            sys.exit(f"--baseline vllm: {exc}")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        attention = {}
        if fca:  # the CUSTOM backend, registered by our vllm.general_plugins entry point
            os.environ[BASE_ENV] = "FLASH_ATTN"  # read in vLLM's processes
            attention = {"attention_config": {"backend": "CUSTOM"}}
        self.fca = fca
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process has used CUDA
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=folder, dtype="bfloat16", seed=0, skip_tokenizer_init=True, enable_prefix_caching=True,
            gpu_memory_utilization=0.85, max_model_len=max_model_len, worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True, **attention))
        self.request_ids = itertools.count()

    async def start(self) -> None:
        if self.fca:  # FCA's builders learn which batches share nothing from the host's block tables
            await self.llm.collective_rpc("arctic_fca_attach_host_tables")

    async def generate(self, prompts: list[list[int]], n: int, max_tokens: int) -> list[list[int]]:
        from vllm.sampling_params import RequestOutputKind

        params = self.vllm.SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                                          detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        # AsyncLLM takes one prompt per request: the call's prompts go in together.
        answers = await asyncio.gather(*(self._request(p, params) for p in prompts))
        return [tokens for answer in answers for tokens in answer]

    async def _request(self, prompt: list[int], params) -> list[list[int]]:
        outputs = []
        async for output in self.llm.generate(self.vllm.TokensPrompt(prompt_token_ids=prompt), params,
                                              str(next(self.request_ids))):
            outputs = output.outputs  # FINAL_ONLY: one output, at the end
        return [list(s.token_ids) for s in sorted(outputs, key=lambda s: s.index)]


@contextlib.asynccontextmanager
async def started(args, folder: str, config: dict) -> AsyncIterator[Arctic | Vllm]:
    """The system under test, shut down (or its server process ended) on the way out."""
    if args.baseline == "vllm":
        backend = Vllm(folder, longest_context(args), args.fca)
        try:
            await backend.start()
            yield backend
        finally:
            backend.llm.shutdown()
    elif args.transport == "http":
        with served(config) as url:
            async with AsyncArcticClient.http(url, timeout=None) as client:  # calls queue behind each other
                yield Arctic(client)
    else:
        async with AsyncArcticClient.in_process(config) as client:
            yield Arctic(client)


@contextlib.contextmanager
def served(config: dict) -> Iterator[str]:
    """``arctic-rl serve`` in a process of its own on a port of 127.0.0.1 the system picks; its URL.
    The process is ended on the way out, whatever happened."""
    with tempfile.TemporaryDirectory() as folder:
        path, log = Path(folder, "arctic.yaml"), Path(folder, "serve.log")
        path.write_text(yaml.safe_dump(config))
        cmd = [sys.executable, "-m", "arctic_core.cli", "serve", "--config", str(path), "--port", "0"]
        with open(log, "w") as stderr:  # a file, not a pipe: the access log of many calls would fill a pipe
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            url = announced_url(proc, log)
            wait_until_serving(url, timeout=600, alive=lambda: proc.poll() is None)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def announced_url(proc: subprocess.Popen, log: Path, timeout: float = 600) -> str:
    """The URL ``serve`` writes to its log once the engines are built (the bound port, for --port 0)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if "Arctic RL serving on " in line:
                return line.split("Arctic RL serving on ")[1].split()[0]
        time.sleep(0.2)
    sys.exit(f"arctic-rl serve did not start; its log ends:\n{log.read_text()[-3000:]}")


# ----------------------------------------------------------------- the workloads
async def call(backend: Arctic | Vllm, prompts: list[list[int]], n: int, max_tokens: int,
               lock: asyncio.Lock | contextlib.nullcontext) -> list[list[int]]:
    """One generate call (behind ``lock`` in --serial mode), its answer checked."""
    async with lock:
        responses = await backend.generate(prompts, n, max_tokens)
    assert len(responses) == len(prompts) * n, f"{len(responses)} responses for {len(prompts)} prompts x {n}"
    assert all(len(r) == max_tokens for r in responses), f"lengths {[len(r) for r in responses]}, not {max_tokens}"
    return responses


async def episode(backend: Arctic | Vllm, prompt: list[int], tool: list[int], args, lock,
                  latencies: list[float], rng: random.Random) -> int:
    """One agent episode; its final history's length. Each tool call takes a time drawn uniformly
    in [0, 2 x --tool-latency] (episodes fall out of step, as with real tools)."""
    history = list(prompt)
    for turn in range(args.turns):
        if turn:
            await asyncio.sleep(rng.uniform(0, 2 * args.tool_latency))  # the tool runs
            history += tool
        begin = time.perf_counter()
        (response,) = await call(backend, [history], 1, args.max_tokens, lock)
        latencies.append(time.perf_counter() - begin)
        history += response
    return len(history)


async def agent(backend: Arctic | Vllm, args, vocab: int, seed: int) -> dict:
    prompts = random_prompts(args.episodes, args.prompt_len, vocab, seed)
    tool = random_prompts(1, args.tool_tokens, vocab, seed=99)[0]
    lock = asyncio.Lock() if args.serial else contextlib.nullcontext()
    latencies: list[float] = []
    run = asyncio.gather(*(episode(backend, p, tool, args, lock, latencies, random.Random(seed * 1000 + i))
                           for i, p in enumerate(prompts)))
    lengths, timing = await measured(backend, run)
    expected = longest_context(args)
    assert lengths == [expected] * args.episodes, f"histories of {lengths} tokens, not {expected}"
    return {"calls": len(latencies), **rate(len(latencies) * args.max_tokens, timing),
            "turn_latency_mean_s": round(sum(latencies) / len(latencies), 3),
            "turn_latency_max_s": round(max(latencies), 3), "final_context_tokens": expected}


async def grpo_calls(backend: Arctic | Vllm, args, vocab: int, seed: int) -> dict:
    lock = asyncio.Lock() if args.serial else contextlib.nullcontext()
    prompts = random_prompts(args.prompts, args.prompt_len, vocab, seed)
    separate = asyncio.gather(*(call(backend, [p], 1, args.max_tokens, lock)
                                for p in prompts for _ in range(args.samples)))
    _, separate_timing = await measured(backend, separate)
    # Other prompts: the one call must not find the separate calls' prompts in the prefix cache.
    prompts = random_prompts(args.prompts, args.prompt_len, vocab, seed + 1000)
    _, one_timing = await measured(backend, call(backend, prompts, args.samples, args.max_tokens, lock))
    tokens = args.prompts * args.samples * args.max_tokens
    return {"separate_calls": {"calls": args.prompts * args.samples, **rate(tokens, separate_timing)},
            "one_call": {"calls": 1, **rate(tokens, one_timing)},
            "separate_over_one": round(separate_timing["seconds"] / one_timing["seconds"], 2)}


WORKLOADS = {"agent": agent, "grpo-calls": grpo_calls}


def longest_context(args) -> int:
    """Prompt and new tokens of the workload's longest sequence (an agent episode's last turn)."""
    if args.workload == "grpo-calls":
        return args.prompt_len + args.max_tokens
    return args.prompt_len + args.turns * args.max_tokens + (args.turns - 1) * args.tool_tokens


async def measured(backend: Arctic | Vllm, work) -> tuple[object, dict]:
    """``work``'s value, and its seconds with the engine's step counts over it (in process)."""
    engine = backend.engine
    before = {k: getattr(engine.stats, k, 0) for k in ENGINE_COUNTERS} if engine is not None else None
    if engine is not None:
        engine.stats.most_running = 0  # this workload's
    begin = time.perf_counter()
    value = await work
    timing = {"seconds": time.perf_counter() - begin, "engine": None}
    if engine is not None:
        timing["engine"] = {k: getattr(engine.stats, k, 0) - before[k] for k in ENGINE_COUNTERS}
        timing["engine"]["most_running"] = engine.stats.most_running
    return value, timing


def rate(tokens: int, timing: dict) -> dict:
    return {"generated_tokens": tokens, "seconds": round(timing["seconds"], 3),
            "gen_tok_per_s": round(tokens / timing["seconds"], 1), "engine": timing["engine"]}


# ----------------------------------------------------------------- runs
def model_folder(name: str) -> str:
    """A shape's random-weight folder (made once), or ``name`` itself as a model folder."""
    if name not in MODELS:
        return name
    folder = f"/tmp/{name}-shape-arctic"  # bench/trl_step.py's folder for the same shape
    make_model(folder, MODELS[name])
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the random init's memory, for the engines
    return folder


def arctic_config(folder: str, cpu: bool, args=None) -> dict:
    sampler = {"options": {"progress": False}}
    if args is not None and args.sampler == "vllm":
        sampler = {"backend": "vllm", "options": {"fca": args.fca, "gpu_memory_utilization": 0.6,
                                                   "max_model_len": longest_context(args)}}
    return {"model": {"path": folder, "dtype": "float32" if cpu else "bfloat16", "device": "cpu" if cpu else "cuda"},
            "trainer": {"backend": "torch"},  # generate needs no trainer; the server builds one, the lightest
            "sampler": sampler, "seed": 0}


async def synced_meanwhile(backend: Arctic | Vllm, work, every: float | None):
    """``work``'s value, with the trainer's weights synced into the sampler every ``every`` seconds
    until it ends; and the number of syncs."""
    if not every:
        return await work, 0
    task, syncs = asyncio.ensure_future(work), 0
    while not task.done():
        await asyncio.wait([task], timeout=every)
        if not task.done():
            await backend.client.sync_weights()
            syncs += 1
    return task.result(), syncs


async def run(args) -> dict:
    folder = model_folder(args.model)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    workload = WORKLOADS[args.workload]
    async with started(args, folder, arctic_config(folder, cpu=False, args=args)) as backend:
        short = argparse.Namespace(**{**vars(args), "max_tokens": min(16, args.max_tokens),
                                      "turns": min(2, args.turns)})
        await workload(backend, short, vocab, seed=1)  # untimed: kernels compiled, graphs captured
        result, syncs = await synced_meanwhile(backend, workload(backend, args, vocab, seed=0), args.sync_every)
        if args.sync_every:
            result |= {"syncs": syncs, "samples_spanning_versions": backend.spanning}
    fca = "+fca" if args.fca else ""
    system = f"vllm{fca}" if args.baseline else "arctic" + (f"/vllm{fca}" if args.sampler == "vllm" else "")
    settings = {k: v for k, v in vars(args).items() if k not in ("smoke", "baseline", "fca")}
    return {"system": system, "device": torch.cuda.get_device_name(), **settings, "result": result}


async def smoke_transport(args, folder: str) -> dict:
    """Both workloads on one transport: agent episodes in flight and serial, then grpo-calls."""
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    out = {}
    async with started(args, folder, arctic_config(folder, cpu=True)) as backend:
        for serial in (False, True):  # prompts of their own each: no prefix found from the other's calls
            out["agent_serial" if serial else "agent"] = await agent(
                backend, argparse.Namespace(**{**vars(args), "serial": serial}), vocab, seed=int(serial))
        out["grpo-calls"] = await grpo_calls(backend, args, vocab, seed=0)
        if args.transport == "in-process":  # weights synced while episodes run
            out["agent_synced"], syncs = await synced_meanwhile(backend, agent(backend, args, vocab, seed=2), 0.02)
            assert syncs > 0, "no sync while the episodes ran"
    if args.transport == "in-process":  # every call decoded: the engine's counts are there
        assert all(out[k]["engine"]["decode_steps"] > 0 for k in ("agent", "agent_serial"))
    return out


def smoke() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        make_model(folder, SMOKE_SHAPE)
        return {"smoke": True, **{transport: asyncio.run(smoke_transport(
            argparse.Namespace(**SMOKE, transport=transport), folder)) for transport in ("in-process", "http")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="agent")
    parser.add_argument("--episodes", type=int, default=64, help="agent: episodes in flight")
    parser.add_argument("--turns", type=int, default=4, help="agent: generate calls per episode")
    parser.add_argument("--tool-tokens", type=int, default=64, help="agent: tokens the tool adds between turns")
    parser.add_argument("--tool-latency", type=float, default=0.0, help="agent: seconds a tool call takes on average")
    parser.add_argument("--prompts", type=int, default=8, help="grpo-calls: prompts")
    parser.add_argument("--samples", type=int, default=8, help="grpo-calls: samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens of every sample (ignore_eos)")
    parser.add_argument("--serial", action="store_true", help="one call in flight at a time")
    parser.add_argument("--model", default="qwen3-1.7b",
                        help=f"a shape ({', '.join(MODELS)}: random bf16 weights) or a model folder")
    parser.add_argument("--transport", choices=["in-process", "http"], default="in-process")
    parser.add_argument("--baseline", choices=["vllm"], help="the same requests on vLLM 0.24's AsyncLLM instead")
    parser.add_argument("--sampler", choices=["embedded", "vllm"], default="embedded",
                        help="Arctic's sampling backend")
    parser.add_argument("--fca", action="store_true", help="with vLLM (--baseline or --sampler): FCA as its attention")
    parser.add_argument("--sync-every", type=float, help="Arctic: sync the trainer's weights every so many seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, both workloads and transports")
    args = parser.parse_args()
    if args.fca and "vllm" not in (args.baseline, args.sampler):
        parser.error("--fca takes effect with vLLM only (--baseline vllm or --sampler vllm)")
    if args.baseline and (args.sync_every or args.sampler != "embedded"):
        parser.error("--sync-every and --sampler are Arctic's: not with --baseline")
    if args.smoke:
        print(json.dumps(smoke()))
        return
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke for the CPU check")
    print(json.dumps(asyncio.run(run(args))))
    if "vllm" in (args.baseline, args.sampler):
        os._exit(0)  # vLLM's engine-core process can hang at interpreter exit


if __name__ == "__main__":
    main()

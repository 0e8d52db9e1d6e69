"""PRIME-RL's orchestrator, as far as the backend can see it: its routes, files and timing.

What PRIME-RL 0.8's orchestrator and its environment servers do, in the same order (see the
PRIME-RL guide and ``arctic_primerl.wire`` for the source commit): wait for ``/health``, check
``/v1/models``, load ``broadcasts/step_0`` (pause, ``update_weights``, resume), then per step sample
each problem ``group_size`` times through ``/inference/v1/generate`` (one sample per call, the
renderer client's body), score the samples, give each the group-centred reward as its advantage on
its completion tokens (PRIME-RL's GRPO), drop groups whose advantages are all zero, pack the
samples into micro-batches of ``seq_len`` tokens and publish ``rollouts/step_N/rank_0.bin``
(written aside, renamed into place). Each step's requests carry one seed, so a run repeats. Like
PRIME-RL it samples one step ahead of the trainer: the batch of step N is generated once the
weights of step N-2 are loaded (``max_lag``). PRIME-RL's own packing is checked byte for byte
against a recorded file in ``test_contract.py``; here the packing is simple.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from arctic_core.demo.grpo import chat_prompt_ids
from arctic_core.demo.task import CountingTask, Problem
from arctic_primerl.wire import MicroBatch, encode



@dataclass
class FakeOrchestrator:
    base_url: str
    run_dir: Path
    model: str
    tokenizer: object
    task: CountingTask
    problems_per_step: int = 8
    group_size: int = 8
    max_tokens: int = 16
    seq_len: int = 256
    temperature: float = 1.0
    seed: int = 0
    headers: dict | None = None
    max_lag: int = 1
    """Steps the sampling may run ahead of the trainer (PRIME-RL's TARGET_LAG is 1; 0 samples each
    step with the weights of the step before, so a run does not depend on timing)."""
    alive: Callable[[], bool] = lambda: True
    """Whether the backend still works; waiting for it stops when it does not."""

    def __post_init__(self) -> None:
        self.version = -1
        self.rewards: list[float] = []
        self.requests: list[dict] = []

    async def run(self, steps: int) -> list[float]:
        async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=600) as http:
            self.http = http
            await self._wait_ready()
            await self._watch()  # v0
            for step in range(1, steps + 1):
                await self._wait_for_version(step - 1 - self.max_lag)  # the ship gate
                self._ship(step, await self._rollouts(step))
                await self._watch()
            await self._wait_for_version(steps)  # the trainer's last weights
        return self.rewards

    async def _wait_for_version(self, version: int) -> None:
        while True:
            alive = self.alive()  # before looking: a trainer that ends after announcing is fine
            await self._watch()
            if self.version >= version:
                return
            if not alive:
                raise RuntimeError(f"the trainer stopped before announcing the weights of step {version}")
            await asyncio.sleep(0.05)

    async def _wait_ready(self) -> None:
        for _ in range(600):
            try:
                if (await self.http.get("/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
        models = (await self.http.get("/v1/models")).json()
        assert self.model in [m["id"] for m in models["data"]], models

    async def _watch(self) -> None:
        """Load the newest announced weights, as PRIME-RL's weight watcher does."""
        stable = [int(p.parent.name.removeprefix("step_")) for p in (self.run_dir / "broadcasts").glob("step_*/STABLE")]
        newest = max(stable, default=-1)
        if newest <= self.version:
            return
        folder = self.run_dir / "broadcasts" / f"step_{newest}"
        (folder / "NCCL_READY").touch()
        (await self.http.post("/pause", params={"mode": "keep", "clear_cache": "false"})).raise_for_status()
        try:
            (await self.http.post("/update_weights", json={"weight_dir": str(folder)})).raise_for_status()
        finally:
            (await self.http.post("/resume")).raise_for_status()
        self.version = newest

    async def _sample(self, prompt: list[int], step: int) -> dict:
        body = {"model": self.model, "token_ids": prompt, "sampling_params": {"seed": self.seed * 100_003 + step,
            "temperature": self.temperature, "top_p": 1.0, "logprobs": 1, "max_tokens": self.max_tokens,
            "top_k": -1, "min_p": 0.0, "return_token_ids": True, "cache_salt": str(self.version),
            "stop_token_ids": [self.tokenizer.eos_token_id], "skip_special_tokens": False}}
        self.requests.append(body)
        answer = await self.http.post("/inference/v1/generate", json=body)
        answer.raise_for_status()
        return answer.json()["choices"][0]

    async def _rollouts(self, step: int) -> list[dict]:
        problems = self.task.problems()
        chosen = [problems[(self.seed + step * 7 + i * 3) % len(problems)] for i in range(self.problems_per_step)]
        prompts = [chat_prompt_ids(self.tokenizer, p) for p in chosen]
        calls = [self._sample(prompt, step) for prompt in prompts for _ in range(self.group_size)]
        choices = await asyncio.gather(*calls)
        samples, scores = [], []
        for g, (problem, prompt) in enumerate(zip(chosen, prompts, strict=True)):
            group = choices[g * self.group_size : (g + 1) * self.group_size]
            rewards = [self._score(problem, c["token_ids"]) for c in group]
            scores += rewards
            mean = sum(rewards) / len(rewards)
            if all(r == mean for r in rewards):
                continue  # filter_zero_advantages: nothing to learn from this group
            for choice, reward in zip(group, rewards, strict=True):
                samples.append(self._sample_record(prompt, choice, reward - mean))
        self.rewards.append(sum(scores) / len(scores))
        return samples

    def _score(self, problem: Problem, tokens: list[int]) -> float:
        return self.task.reward(problem, self.tokenizer.decode(tokens, skip_special_tokens=True))

    def _sample_record(self, prompt: list[int], choice: dict, advantage: float) -> dict:
        completion = choice["token_ids"]
        logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
        n = len(prompt) + len(completion)
        return {"input_ids": prompt + completion, "loss_mask": [False] * len(prompt) + [True] * len(completion),
                "advantages": [0.0] * len(prompt) + [advantage] * len(completion),
                "inference_logprobs": [0.0] * len(prompt) + logprobs, "temperatures": [self.temperature] * n}

    def _ship(self, step: int, samples: list[dict]) -> None:
        bins: list[list[dict]] = []
        # First fit, longest first; ties by tokens, so the packing does not depend on arrival order.
        for sample in sorted(samples, key=lambda s: (-len(s["input_ids"]), s["input_ids"])):
            for b in bins:
                if sum(len(s["input_ids"]) for s in b) + len(sample["input_ids"]) <= self.seq_len:
                    b.append(sample)
                    break
            else:
                bins.append([sample])
        batches = [pack(b) for b in bins]
        folder = self.run_dir / "rollouts" / f"step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / "rank_0.bin.tmp"
        tmp.write_bytes(encode(batches))
        os.rename(tmp, folder / "rank_0.bin")


def pack(samples: list[dict]) -> MicroBatch:
    lengths = [len(s["input_ids"]) for s in samples]
    flat = {key: [v for s in samples for v in s[key]] for key in samples[0]}
    return MicroBatch(**flat, position_ids=[t for n in lengths for t in range(n)], sequence_lengths=lengths,
                      env_names=["counting"] * sum(lengths), seq_lens=lengths)


def main() -> None:
    """``python fake_orchestrator.py @ orchestrator.json``: started by ``arctic-primerl rl`` as its
    ``orchestrator_command``, it reads the config written for PRIME-RL's orchestrator and runs the
    demo's counting task, small (2 problems of 4 samples a step), for max_steps steps."""
    config = json.loads(Path(sys.argv[-1]).read_text())
    model = config["model"]["name"]
    orchestrator = FakeOrchestrator(config["model"]["client"]["base_url"].removesuffix("/v1"),
                                    Path(config["output_dir"]),
                                    model, AutoTokenizer.from_pretrained(model), CountingTask(), problems_per_step=2,
                                    group_size=4, max_tokens=8, seq_len=config["seq_len"])
    asyncio.run(orchestrator.run(config["max_steps"]))


if __name__ == "__main__":
    main()

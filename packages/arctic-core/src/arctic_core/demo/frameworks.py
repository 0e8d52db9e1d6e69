"""The demo's task through a framework's own training loop, on the CPU.

What ``python -m arctic_verl.example counting`` and ``python -m arctic_skyrl.example counting``
share: under ``--out`` they write the tiny policy after the demo's SFT warm-up and the task's
prompts in the framework's dataset format, run the framework's own entry point with the Arctic
switch as a child process (its whole output in ``run.log`` there), print the mean reward of each
step as the framework logs it, and end on one JSON line on stdout, as the demo does.

The task is the demo's "repeat a digit" part, which GRPO teaches the tiny policy within minutes of
CPU time. The frameworks do not seed their sampling, so single steps are noisy: the summary
compares the mean of the first steps with that of the last ones.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from arctic_core.demo.task import CountingTask, Problem

TASK = CountingTask(ops=("repeat",))
STEPS = 45
WINDOW = 5  # steps averaged at each end of the run
BATCH, SAMPLES, RESPONSE_TOKENS = 8, 16, 16  # prompts per step, samples per prompt, tokens per sample
LR = 1e-3  # high for a real model: the tiny one learns the task within STEPS at it
OURS = {"warmup", "task.parquet", "run.log", "summary.json"}  # what this module writes under --out
TAIL_LINES = 40  # of the framework's output, shown when its run fails


@dataclass(frozen=True)
class RunPaths:
    """Absolute paths of one run's inputs and outputs (the child runs in ``out``)."""

    out: Path
    policy: Path
    data: Path


@dataclass(frozen=True)
class Framework:
    """One framework's side of the example: its dataset rows, its command line, and the line of its
    output that logs a step's mean reward (``step_line``: groups ``step`` and ``reward``, or
    ``reward`` alone when the framework logs the steps in order without their number)."""

    name: str
    outputs: frozenset[str]  # what its run writes under --out
    rows: Callable[[list[Problem]], list[dict]]
    command: Callable[[RunPaths, int], list[str]]
    step_line: re.Pattern[str]

    def step_reward(self, line: str) -> tuple[int | None, float] | None:
        """(the step, or None for the next one; its mean reward) of a line that logs one."""
        match = self.step_line.search(line)
        if match is None:
            return None
        step = match.groupdict().get("step")
        return (int(step) if step is not None else None), float(match.group("reward"))


def score(prompt: str, completion: str) -> float:
    """The task's reward of ``completion`` for the row whose ground truth is ``prompt`` (a prompt of
    any part of the demo's task)."""
    return TASK.reward(CountingTask().problem(prompt), completion)


def main(framework: Framework, argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(framework.name, argv)
    start = time.perf_counter()
    paths = prepare(framework, args.out.resolve())
    rewards = run(framework, paths, args.steps)
    summary = summarize(framework.name, rewards, paths.out, time.perf_counter() - start)
    print(json.dumps(summary), flush=True)
    return summary


def parse_args(name: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m arctic_{name}.example",
        description=f"GRPO on the demo's counting task through {name}'s own training loop on Arctic, on the CPU.")
    parser.add_argument("task", choices=["counting"])
    parser.add_argument("--out", type=Path, default=Path(f"runs/{name}-counting"),
                        help="folder for the model, the data, the logs and the summary (an earlier run's is replaced)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"GRPO steps (default {STEPS})")
    args = parser.parse_args(argv)
    if args.steps < 2 * WINDOW:
        parser.error(f"--steps must be at least {2 * WINDOW}: the reward is compared over {WINDOW} steps at each end")
    return args


def prepare(framework: Framework, out: Path) -> RunPaths:
    """Warm up the tiny policy and write the task's prompts, under ``out``."""
    from transformers.utils import logging as hf_logging

    from arctic_core.cli import stdout_to_stderr
    from arctic_core.demo.grpo import clear_earlier_run, warmed_up_policy
    from arctic_core.quiet import hide_banners

    clear_earlier_run(out, OURS | framework.outputs, owner="example")
    out.mkdir(parents=True, exist_ok=True)
    hide_banners()  # as the demo: no "no GPU found" banners on a run that asked for the CPU
    hf_logging.disable_progress_bar()  # nor a bar for each save and load of the tiny model
    with stdout_to_stderr():  # stdout carries the summary alone
        policy = warmed_up_policy(out / "warmup", TASK.ops)
    data = write_parquet(framework.rows(TASK.problems()), out / "task.parquet")
    return RunPaths(out=out, policy=policy, data=data)


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pandas as pd  # every framework's environment has it; the workspace's need not

    pd.DataFrame(rows).to_parquet(path)
    return path


def run(framework: Framework, paths: RunPaths, steps: int) -> list[float]:
    """Run the framework, its output into ``run.log``; print each step's reward as it is logged."""
    command = framework.command(paths, steps)
    log = paths.out / "run.log"
    print(f"running {framework.name} (its output: {log}):\n  {' '.join(command)}", file=sys.stderr, flush=True)
    rewards: dict[int, float] = {}

    def on_line(line: str) -> None:
        found = framework.step_reward(line)
        if found is None:
            return
        step, reward = found
        step = len(rewards) + 1 if step is None else step
        if step not in rewards:  # a framework may print a step's metrics twice
            rewards[step] = reward
            print(f"{framework.name} step {step}/{steps}: reward {reward:.3f}", file=sys.stderr, flush=True)

    returncode = follow(command, paths.out, child_env(framework, paths), log, on_line)
    if returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        print("\n".join(tail), file=sys.stderr)
        sys.exit(f"{framework.name}'s run failed (exit status {returncode}); its whole output: {log}")
    return [rewards[step] for step in sorted(rewards)]


def child_env(framework: Framework, paths: RunPaths) -> dict[str, str]:
    # One thread per process: the frameworks start several Ray workers, and the tiny model gains
    # nothing from more. Unbuffered, so that each step's line arrives when it is logged; every
    # worker's lines kept (Ray would fold repeated ones).
    fixed = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1"}
    return {**os.environ, **fixed, "TENSORBOARD_DIR": str(paths.out / "tensorboard")}  # both frameworks read it


def follow(command: list[str], cwd: Path, env: dict[str, str], log: Path, on_line: Callable[[str], None]) -> int:
    """Run ``command``, its stdout and stderr into ``log`` line by line, each line also to ``on_line``."""
    with log.open("w") as sink, subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        for line in proc.stdout:
            sink.write(line)
            on_line(line)
    return proc.returncode


def summarize(name: str, rewards: list[float], out: Path, seconds: float) -> dict[str, object]:
    window = min(WINDOW, max(1, len(rewards) // 2))
    summary = {
        "framework": name,
        "initial_reward": round(sum(rewards[:window]) / window, 4) if rewards else None,
        "final_reward": round(sum(rewards[-window:]) / window, 4) if rewards else None,
        "steps": len(rewards),
        "reward_window": window,
        "seconds": round(seconds, 1),
        "rewards": [round(reward, 4) for reward in rewards],
        "out": str(out),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary

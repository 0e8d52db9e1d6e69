"""What the framework adapters' test suites check the same way, each in its framework's environment
(the repository's ``tests/`` folder is on every suite's path): data in the frameworks' GSM8K
layout, the guides' learning commands, a run whose server goes away mid-run, and a run whose
generate calls share the sampler's steps."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fault_server import start_for
from recipes.common import skyrl_row
from recipes.gsm8k.prepare_data import ENV_CLASS, prepare_record

GUIDES = Path(__file__).resolve().parents[1] / "docs" / "guides"
LEARNING_SECTION = "## See it learn on the CPU"
LEARNING_GAIN = 0.25  # the least rise of the mean reward between the first and the last steps
RERUN = "restart it and rerun to resume from the last checkpoint"


def gsm8k_rows(count: int, layout: str = "verl") -> list[dict]:
    """``count`` small additions as the GSM8K recipe prepares them, in verl's layout (verl's own
    GSM8K scorer reads them) or SkyRL's (skyrl-gym's GSM8K environment scores them)."""
    rows = [prepare_record({"question": f"What is {3 + i} plus {4 + 2 * i}?", "answer": f"#### {7 + 3 * i}"},
                           i, "train")
            for i in range(count)]
    return rows if layout == "verl" else [skyrl_row(row, ENV_CLASS) for row in rows]


def documented_command(guide: str, environment: str) -> list[str]:
    """The command of the guide's "See it learn on the CPU" section, less the ``uv run`` that picks
    the framework's environment (the one the suite runs in)."""
    section = (GUIDES / guide).read_text().split(LEARNING_SECTION, 1)[1].split("\n## ", 1)[0]
    code = re.search(r"^```bash\n(.*?)^```", section, re.S | re.M).group(1)
    command = shlex.split(code, comments=True)
    prefix = shlex.split(environment)
    assert command[:len(prefix)] == prefix, command
    return [sys.executable if arg == "python" else arg for arg in command[len(prefix):]]


def check_learning_run(guide: str, environment: str, framework: str, tmp_path: Path) -> dict:
    """Run the guide's learning command as written, in ``tmp_path``: the framework's own loop raises
    the mean reward by LEARNING_GAIN over its 45 steps (five-step windows), logs a line per step,
    and writes under ``runs/`` only."""
    command = documented_command(guide, environment)
    assert command[1:4] == ["-m", f"arctic_{framework}.example", "counting"], command
    result = subprocess.run(command, cwd=tmp_path, env=os.environ, capture_output=True, text=True, timeout=1400)
    assert result.returncode == 0, result.stderr[-6000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"{framework} GRPO on Arctic: reward {summary['initial_reward']:.3f} -> {summary['final_reward']:.3f} "
          f"over {summary['steps']} steps, {summary['seconds']} s")
    assert summary["steps"] == 45 and summary["reward_window"] == 5, summary
    assert summary["final_reward"] - summary["initial_reward"] >= LEARNING_GAIN, summary
    assert f"{framework} step 45/45: reward" in result.stderr  # a line per step, as the framework logs it
    out = Path(summary["out"])
    assert out.is_relative_to(tmp_path / "runs") and [p.name for p in tmp_path.iterdir()] == ["runs"]
    assert json.loads((out / "summary.json").read_text()) == summary
    assert list((out / "tensorboard").rglob("events.out.tfevents.*")) and (out / "run.log").stat().st_size > 0
    return summary


def check_run_ends_on_lost_server(policy: Path, adapter: str, run: Callable[[str], subprocess.CompletedProcess[str]],
                                  rerun: str = RERUN) -> subprocess.CompletedProcess[str]:
    """``run(url)`` (stdout and stderr merged) against an ``arctic-rl serve`` of ``policy`` at ``url``
    that kills itself (SIGKILL) when a sampling request follows the first optimizer step: the run
    ends with exit status 2 on one line naming the server that went away."""
    server, url = start_for(policy, "generate-after-step")
    try:
        result = run(url)
        gone = server.poll()  # it killed itself before the run ended
    finally:
        server.kill()
    output = result.stdout
    assert gone == -signal.SIGKILL, output[-6000:]
    assert result.returncode == 2, output[-6000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"{adapter}: error: the Arctic server at {url} went away (ConnectError"), output[-6000:]
    assert last.endswith(rerun)
    assert output.count(f"{adapter}: error:") == 1
    return result


@contextlib.contextmanager
def serving(policy: Path) -> Iterator[str]:
    """An ``arctic-rl serve`` of ``policy`` (``tests/fault_server.py``, never killing itself) for a
    framework's run on its URL; the test reads the server's ``/metrics`` after the run."""
    server, url = start_for(policy, "never")
    try:
        yield url
    finally:
        server.kill()
        server.wait()


def check_calls_share_steps(url: str, calls: int, samples_per_call: int = 1) -> dict[str, float]:
    """The server at ``url`` answered ``calls`` generate calls of ``samples_per_call`` samples each
    (a framework's agent loop asks for a sample per call, or per prompt group once the adapter's
    rollout client has gathered them), and its sampler decoded them in shared steps; returns the
    figures (printed too).

    A sample whose response has L tokens needs L - 1 decode steps (its first token comes from the
    prompt's prefill), and a call as many as its longest sample, at least its mean: run one at a time,
    as a server serialising its generate calls runs them, the calls would need at least generated
    tokens / samples per call - calls decode steps. Calls in flight together join the running batch
    at its next step and share each step (the engine's continuous batching across calls): the sampler
    must have run fewer than half as many."""
    families = list(text_string_to_metric_families(httpx.get(f"{url}/metrics").text))

    def value(name: str, **labels: str) -> float:
        return next((s.value for f in families for s in f.samples if s.name == name and s.labels == labels), 0.0)

    figures = {"calls": value("arctic_calls_total", op="generate", outcome="ok"),
               "generated_tokens": value("arctic_tokens_total", op="generate"),
               "decode_steps": value("arctic_sampler_decode_steps_total")}
    figures["one_at_a_time"] = figures["generated_tokens"] / samples_per_call - figures["calls"]
    print("generate calls and the sampler's decode steps:", figures)
    assert figures["calls"] == calls, figures  # every call answered (none failed, none split)
    assert 0 < figures["decode_steps"] < figures["one_at_a_time"] / 2, figures
    return figures

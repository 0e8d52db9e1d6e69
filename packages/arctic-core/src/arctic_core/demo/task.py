"""The demo's verifiable task: repeat a digit, or count up or down from it.

Prompts: ``"repeat 7"`` -> ``"7 7 7 7 7 7"``, ``"count up from 7"`` -> ``"7 8 9 0 1 2"`` (mod 10),
``"count down from 7"`` -> ``"7 6 5 4 3 2"``. The reward is the fraction of the six positions that
hold the right digit (extra items count as wrong): checked exactly by a program, with partial
credit so that a policy can improve one position at a time.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

STEPS = {"repeat": 0, "up": 1, "down": -1}


@dataclass(frozen=True)
class Problem:
    op: str
    start: int

    @property
    def prompt(self) -> str:
        return f"repeat {self.start}" if self.op == "repeat" else f"count {self.op} from {self.start}"


@dataclass(frozen=True)
class CountingTask:
    length: int = 6
    ops: tuple[str, ...] = ("repeat", "up", "down")

    def problems(self) -> list[Problem]:
        return [Problem(op, s) for op in self.ops for s in range(10)]

    def sample(self, rng: random.Random, k: int) -> list[Problem]:
        return [rng.choice(self.problems()) for _ in range(k)]

    def problem(self, prompt: str) -> Problem:
        """The problem whose prompt is ``prompt`` (what a framework's dataset row keeps as its ground truth)."""
        for problem in self.problems():
            if problem.prompt == prompt:
                return problem
        raise ValueError(f"no problem of the task has the prompt {prompt!r}")

    def answer(self, problem: Problem) -> str:
        step = STEPS[problem.op]
        return " ".join(str((problem.start + step * i) % 10) for i in range(self.length))

    def reward(self, problem: Problem, completion: str) -> float:
        """Fraction of positions with the right digit; anything that is not a digit is wrong."""
        items = completion.split()
        expected = self.answer(problem).split()
        hits = sum(1 for got, want in zip(items, expected, strict=False) if got == want)
        return hits / max(len(expected), len(items))

    def corpus(self) -> list[str]:
        """Text to train the tokenizer on: every prompt and answer."""
        return [f"{p.prompt} {self.answer(p)}" for p in self.problems()] * 4


def is_well_formed(text: str, length: int) -> bool:
    return re.fullmatch(rf"\d( \d){{{length - 1}}}", text.strip()) is not None

"""Multi-hop QA's reward: the completion's answer against the gold answer and its aliases, by
token F1 (or exact match) after the standard answer normalisation (SQuAD's: lower case, no
punctuation, no articles, single spaces; punctuation is ASCII's and any Unicode punctuation,
such as curly quotes and "。"); the best over the gold answers.

The answer is the text after the completion's last "Answer:" (else its last non-empty line).
Entry points: ``reward`` for TRL (dataset column ``answers``) and ``compute_score`` for verl
(``ground_truth``: the answer; ``extra_info["answers"]``: it and its aliases).
"""

from __future__ import annotations

import functools
import re
import string
import unicodedata
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")


@functools.lru_cache(maxsize=4096)
def _is_punctuation(char: str) -> bool:
    # string.punctuation also holds ASCII symbols ($, +, <, ...) that SQuAD strips and Unicode
    # files under S*, not P*.
    return char in string.punctuation or unicodedata.category(char).startswith("P")


def normalize(text: str) -> str:
    text = "".join(char for char in text.lower() if not _is_punctuation(char))
    return " ".join(_ARTICLES.sub(" ", text).split())


def extract_answer(completion: str) -> str:
    marker = completion.lower().rfind("answer:")
    if marker >= 0:
        return completion[marker + len("answer:") :].strip().split("\n")[0]
    lines = [line for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize(prediction) == normalize(gold))


def f1(prediction: str, gold: str) -> float:
    predicted, expected = normalize(prediction).split(), normalize(gold).split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if not predicted or not expected:
        return float(predicted == expected)
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


METRICS = {"f1": f1, "em": exact_match}


def score(completion: str, answers: list[str] | str, metric: str = "f1") -> float:
    """The best ``metric`` ("f1" or "em") of the completion's answer over the gold ``answers``."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}: use one of {', '.join(map(repr, METRICS))}")
    measure = METRICS[metric]
    answers = [answers] if isinstance(answers, str) else list(answers)
    prediction = extract_answer(completion)
    return max((measure(prediction, gold) for gold in answers), default=0.0)


def reward(completions: list, answers: list, **kwargs) -> list[float]:
    """TRL reward function (completions as strings or chat messages)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [score(text, gold) for text, gold in zip(texts, answers, strict=True)]


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float:
    """verl custom reward function: ``ground_truth`` is the answer, ``extra_info["answers"]`` (when
    present) all accepted answers (a string column, as in verl's other data sets)."""
    return score(solution_str, (extra_info or {}).get("answers") or ground_truth)

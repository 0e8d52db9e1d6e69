"""Multi-hop QA's reward: the completion's answer against the gold answer and its aliases, by
token F1 (or exact match) after the standard answer normalisation (SQuAD's: lower case, no
punctuation, no articles, single spaces); the best over the gold answers.

The answer is the text after the completion's last "Answer:" (else its last non-empty line).
Entry points: ``reward`` for TRL (dataset column ``answers``) and ``compute_score`` for verl
(``ground_truth``: the answer; ``extra_info["answers"]``: it and its aliases).
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


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


def score(completion: str, answers: list[str] | str, metric: str = "f1") -> float:
    answers = [answers] if isinstance(answers, str) else list(answers)
    measure = f1 if metric == "f1" else exact_match
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

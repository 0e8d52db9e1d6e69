"""GSM8K's reward: the completion's final number against the reference answer, numerically.

The final answer is read, in order of preference, from the last ``\\boxed{...}``, the last
``#### ...`` line, the last "answer is ..." phrase, and otherwise the last number in the text.
Numbers are compared as exact fractions after removing thousands separators, currency signs,
percent signs and trailing units ("$1,200.50", "1200.5 dollars" and "\\frac{2401}{2}" all match
1200.5). A thousands separator is a comma, a no-break or a thin space between groups of three
digits ("1,000", "1 000"; "1,2,3" is three numbers); "−" (the minus sign) is a minus; an exponent
is read ("3.0e2" is 300); a time of day ("2:30", "14:05:10") is not a number answer.

Two entry points: ``reward`` for TRL (``reward_funcs=[reward]``, the dataset's ``answer`` column
arrives as a keyword) and ``compute_score`` for verl (``custom_reward_function.path=<this file>``).
"""

from __future__ import annotations

import re
from fractions import Fraction

# Digits grouped by threes with one separator throughout (a comma, a no-break, a narrow no-break or
# a thin space), else plain digits; then decimals, an exponent and a denominator.
_SEPARATORS = ",\u00a0\u202f\u2009"
NUMBER = (rf"-?(?:\d{{1,3}}(?P<sep>[{_SEPARATORS}])\d{{3}}(?:(?P=sep)\d{{3}})*(?!\d)|\d+)"
          r"(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?|-?\.\d+(?:[eE][-+]?\d+)?")
_BOXED = re.compile(r"\\boxed\s*\{")
# The rest of the line is captured in a lookahead, so a second marker on the same line is a match
# of its own ("the answer is 4; no, the answer is 5" reads 5).
_HASHES = re.compile(r"####\s*(?=([^\n]*))")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*(?=([^\n]*))", re.IGNORECASE)
_FRAC = re.compile(r"\\d?frac\{(-?[\d.,]+)\}\{(-?[\d.,]+)\}")
_TIME = re.compile(r"(?<![\d:.])\d{1,2}:\d{2}(?::\d{2})?(?![\d:])")  # h:mm or h:mm:ss
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_NUMBER = re.compile(NUMBER)
MAX_EXPONENT = 1000  # 10**exponent is computed exactly: a huge one would stall the reward


def numbers(text: str) -> list[str]:
    """The numbers in ``text`` as written, LaTeX fractions as "a/b" and times of day left out."""
    text = _FRAC.sub(r"\1/\2", text.replace("\\!", "").replace("{,}", ",").translate(_MINUS_SIGNS))
    return [m.group(0) for m in _NUMBER.finditer(_TIME.sub(" ", text))]


def extract_answer(text: str) -> str | None:
    """The text of the completion's final answer (None when it has no number at all)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (_HASHES, _ANSWER_IS):
        found = [m.group(1) for m in pattern.finditer(text) if numbers(m.group(1))]
        if found:
            return found[-1]
    found = numbers(text)
    return found[-1] if found else None


def parse_number(text: str | None) -> Fraction | None:
    """The first number in ``text`` as an exact fraction ("$1,200.50" -> 2401/2, "\\frac{3}{4}" -> 3/4)."""
    found = numbers(text) if text is not None else []
    if not found:
        return None
    number = re.sub(f"[{_SEPARATORS}]", "", found[0])
    top, _, bottom = number.partition("/")
    try:
        value = _fraction(top)
        return value / _fraction(bottom) if bottom else value
    except (ValueError, ZeroDivisionError):
        return None


def _fraction(number: str) -> Fraction:
    """``number`` exactly; ValueError for an exponent beyond ``MAX_EXPONENT``."""
    exponent = re.split("[eE]", number)[1:]
    if exponent and abs(int(exponent[0])) > MAX_EXPONENT:
        raise ValueError(f"exponent out of range: {number}")
    return Fraction(number)


def gold_answer(answer_field: str) -> str:
    """The reference number of a GSM8K ``answer`` field (the text after its ``####``)."""
    marker = answer_field.rfind("####")
    if marker < 0:
        raise ValueError("no '####' in the answer")
    value = answer_field[marker + 4 :].strip()
    if parse_number(value) is None:
        raise ValueError(f"the answer after '####' is not a number: {value!r}")
    return value.replace(",", "")


def score(completion: str, reference: str) -> float:
    """1.0 when the completion's final answer equals ``reference`` as a number, else 0.0."""
    predicted, expected = parse_number(extract_answer(completion)), parse_number(reference)
    return float(predicted is not None and expected is not None and predicted == expected)


def reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function: ``completions`` as strings or as chat messages."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [score(text, ref) for text, ref in zip(texts, answer, strict=True)]


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """verl custom reward function."""
    return score(solution_str, ground_truth)


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for index in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start:index]
    return None

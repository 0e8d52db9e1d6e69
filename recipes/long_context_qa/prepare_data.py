"""Multi-hop QA in HotpotQA's or MuSiQue's public format to long-context rows: each question's
supporting paragraphs packed with distractors (its own, then other questions') until the prompt
reaches a target length.

    python -m recipes.long_context_qa.prepare_data --records ~/hotpotqa/hotpot_train_v1.1.json \\
        --tokenizer Qwen/Qwen3-32B --target-tokens 32768 --split train --out ~/data/mhqa

HotpotQA: ``question``, ``answer``, ``context`` ([title, sentences] pairs), ``supporting_facts``.
MuSiQue (``.jsonl``): ``question``, ``answer``, ``answer_aliases``, ``paragraphs`` (``title``,
``paragraph_text``, ``is_supporting``), ``answerable``. The target counts the whole prompt: the
documents with their headers, the question and the instruction. Records without a question, an
answer or a supporting paragraph, records with a malformed field, unanswerable ones, and ones whose
supporting paragraphs alone do not fit the target are counted, listed in
``<split>.rejected.jsonl`` and left out.

``--records`` may also be a ``.parquet`` file or a saved Hugging Face dataset folder of either
format's fields. ``--format`` picks the files (default ``trl verl``: ``<split>.jsonl`` and
``<split>.parquet``); ``skyrl`` writes ``<split>.skyrl.parquet`` for the ``long_context_qa``
environment of ``recipes.skyrl_env``, which scores with this recipe's reward.
"""

from __future__ import annotations

import argparse
import functools
import random
from dataclasses import dataclass, replace
from pathlib import Path

from recipes.common import (PrepReport, add_format_argument, description, list_field, prepare_rows, text_field,
                            write_split)

DATA_SOURCE = "multihop_qa"
ENV_CLASS = "long_context_qa"  # SkyRL's environment for these rows: recipes.skyrl_env registers it
INSTRUCTION = ("Answer the question from the documents. Think step by step, then give a short answer "
               "on the last line as 'Answer: <answer>'.")


@dataclass(frozen=True)
class Paragraph:
    title: str
    text: str
    supporting: bool

    def render(self, number: int) -> str:
        return f"Document [{number}] (Title: {self.title})\n{self.text}"


@dataclass(frozen=True)
class Question:
    question: str
    answers: list[str]
    paragraphs: list[Paragraph]


def parse(record: object) -> Question:
    """A HotpotQA or MuSiQue record; ValueError names what is missing or malformed."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    question, answer = text_field(record, "question"), text_field(record, "answer")
    if record.get("answerable") is False:
        raise ValueError("unanswerable")
    if "paragraphs" in record:  # MuSiQue
        paragraphs = [_musique_paragraph(p) for p in list_field(record, "paragraphs")]
        aliases = list_field(record, "answer_aliases")
        if not all(isinstance(alias, str) for alias in aliases):
            raise ValueError("malformed answer_aliases: expected a list of text")
        answers = [answer, *aliases]
    elif "context" in record:  # HotpotQA
        support = {_pair(fact, "supporting_facts", int)[0] for fact in list_field(record, "supporting_facts")}
        context = [_pair(item, "context", list) for item in list_field(record, "context")]
        if not all(isinstance(sentence, str) for _, sentences in context for sentence in sentences):
            raise ValueError("malformed context: a sentence is not text")
        paragraphs = [Paragraph(title, "".join(sentences), title in support) for title, sentences in context]
        answers = [answer]
    else:
        raise ValueError("neither HotpotQA's context nor MuSiQue's paragraphs")
    if not any(p.supporting for p in paragraphs):
        raise ValueError("no supporting paragraph")
    return Question(question, answers, paragraphs)


def _musique_paragraph(item: object) -> Paragraph:
    if not isinstance(item, dict):
        raise ValueError("malformed paragraphs: an item is not a JSON object")
    title, text = text_field(item, "title", required=False), item.get("paragraph_text")
    if not isinstance(text, str):
        raise ValueError("malformed paragraphs: a paragraph_text is not text")
    return Paragraph(title, text, bool(item.get("is_supporting")))


def _pair(item: object, field: str, second: type) -> tuple[str, object]:
    """A HotpotQA ``[title, value]`` pair (``value`` of type ``second``); ValueError naming ``field``."""
    if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], second)):
        raise ValueError(f"malformed {field}: expected [title, {second.__name__}] pairs, got {item!r}")
    return item[0], item[1]


def render_prompt(question: Question, paragraphs: list[Paragraph]) -> str:
    documents = "\n\n".join(p.render(i + 1) for i, p in enumerate(paragraphs))
    return f"{documents}\n\nQuestion: {question.question}\n\n{INSTRUCTION}"


class Packer:
    """Fills each question's prompt up to ``target`` tokens: its supporting paragraphs, its own
    distractors, then paragraphs of other questions drawn at random (seeded) until ``max_misses``
    draws in a row do not fit. The target bounds the whole rendered prompt (documents with their
    headers, the question, the instruction), which is what verl's ``max_prompt_length`` sees."""

    def __init__(self, count_tokens, target: int, pool: list[Paragraph], seed: int, max_misses: int = 64) -> None:
        self.target, self.pool, self.rng, self.max_misses = target, pool, random.Random(seed), max_misses
        self.count_tokens = count_tokens  # whole prompts: too large and too many to cache
        self.count_cached = functools.lru_cache(maxsize=1 << 16)(count_tokens)

    def cost(self, paragraph: Paragraph) -> int:
        """A document's share of the prompt, estimated: its number and the tokenizer's merges
        across the join vary, so ``fit`` checks the rendered prompt."""
        return self.count_cached("\n\n" + paragraph.render(0))

    def pack(self, question: Question) -> list[Paragraph]:
        supporting = [p for p in question.paragraphs if p.supporting]
        used = self.count_tokens(render_prompt(question, supporting))
        if used > self.target:
            raise ValueError(f"supporting paragraphs exceed the target: the prompt with them alone is {used} > "
                             f"{self.target} tokens")
        added = []
        for paragraph in question.paragraphs:  # its own distractors first
            if not paragraph.supporting and used + self.cost(paragraph) <= self.target:
                added.append(paragraph)
                used += self.cost(paragraph)
        self.draw_distractors(used, {p.title for p in question.paragraphs}, added)
        chosen = supporting + added
        self.rng.shuffle(chosen)
        return self.fit(question, chosen, added)

    def draw_distractors(self, used: int, titles: set[str], added: list[Paragraph]) -> None:
        """Append to ``added`` paragraphs of the pool whose titles are not in ``titles`` while they
        fit, until ``max_misses`` draws in a row do not."""
        misses = 0
        while misses < self.max_misses and self.pool:
            paragraph = self.pool[self.rng.randrange(len(self.pool))]
            if paragraph.title in titles or used + self.cost(paragraph) > self.target:
                misses += 1
                continue
            # Another question's paragraph (supporting there or not) is a distractor here.
            added.append(replace(paragraph, supporting=False))
            titles.add(paragraph.title)
            used, misses = used + self.cost(paragraph), 0

    def fit(self, question: Question, chosen: list[Paragraph], added: list[Paragraph]) -> list[Paragraph]:
        """``chosen`` less distractors (the last added first) until the rendered prompt fits."""
        while (over := self.count_tokens(render_prompt(question, chosen)) - self.target) > 0:
            if not added:
                raise ValueError(f"supporting paragraphs exceed the target: {over} tokens over {self.target}")
            while over > 0 and added:
                paragraph = added.pop()
                chosen.remove(paragraph)
                over -= self.cost(paragraph)
        return chosen


def build_row(question: Question, paragraphs: list[Paragraph], index: int, split: str) -> dict:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": render_prompt(question, paragraphs)}],
            "ability": "qa", "answers": question.answers,
            "reward_model": {"style": "rule", "ground_truth": question.answers[0]},
            "extra_info": {"split": split, "index": index, "answers": question.answers,
                           "supporting": [i + 1 for i, p in enumerate(paragraphs) if p.supporting]}}


def token_counter(tokenizer: str | None):
    if tokenizer is None:
        return lambda text: len(text.split())
    from transformers import AutoTokenizer

    encode = AutoTokenizer.from_pretrained(tokenizer).encode
    return lambda text: len(encode(text, add_special_tokens=False))


def main(argv: list[str] | None = None) -> PrepReport:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--records", required=True, type=Path, help="HotpotQA .json or MuSiQue .jsonl")
    parser.add_argument("--target-tokens", type=int, default=32768, help="the prompt length to pack to")
    parser.add_argument("--tokenizer", default=None, help="tokenizer counting the length (default: words)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--seed", type=int, default=0)
    add_format_argument(parser)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    if not args.records.exists():
        parser.error(f"not found: {args.records}")
    if args.target_tokens < 1:
        parser.error(f"--target-tokens must be positive, got {args.target_tokens}")
    questions, report = prepare_rows(args.records, lambda record, index: (index, parse(record)))
    pool = [p for _, q in questions for p in q.paragraphs]
    packer = Packer(token_counter(args.tokenizer), args.target_tokens, pool, args.seed)
    rows = []
    for index, question in questions:  # index: the record's place in the release
        try:
            rows.append(build_row(question, packer.pack(question), index, args.split))
        except ValueError as exc:
            report.withdraw(index, str(exc), question.question)
    write_split(rows, args.out, args.split, report, args.formats, ENV_CLASS)
    return report


if __name__ == "__main__":
    main()

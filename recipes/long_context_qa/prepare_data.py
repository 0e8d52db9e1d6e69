"""Multi-hop QA in HotpotQA's or MuSiQue's public format to long-context rows: each question's
supporting paragraphs packed with distractors (its own, then other questions') to a target length.

    python -m recipes.long_context_qa.prepare_data --records ~/hotpotqa/hotpot_train_v1.1.json \\
        --tokenizer Qwen/Qwen3-32B --target-tokens 32768 --split train --out ~/data/mhqa

HotpotQA: ``question``, ``answer``, ``context`` ([title, sentences] pairs), ``supporting_facts``.
MuSiQue (``.jsonl``): ``question``, ``answer``, ``answer_aliases``, ``paragraphs`` (``title``,
``paragraph_text``, ``is_supporting``), ``answerable``. Records without a question, an answer or
a supporting paragraph, unanswerable ones, and ones whose supporting paragraphs alone exceed the
target are counted, listed in ``<split>.rejected.jsonl`` and left out.
"""

from __future__ import annotations

import argparse
import functools
import random
from dataclasses import dataclass, replace
from pathlib import Path

from recipes.common import PrepReport, prepare_rows, write_split

DATA_SOURCE = "multihop_qa"
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
    """A HotpotQA or MuSiQue record; ValueError names what is missing."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if not str(record.get("question") or "").strip() or not str(record.get("answer") or "").strip():
        raise ValueError("missing question or answer")
    if record.get("answerable") is False:
        raise ValueError("unanswerable")
    if "paragraphs" in record:  # MuSiQue
        paragraphs = [Paragraph(p.get("title", ""), p.get("paragraph_text", ""), bool(p.get("is_supporting")))
                      for p in record["paragraphs"]]
        answers = [record["answer"], *record.get("answer_aliases", [])]
    elif "context" in record:  # HotpotQA
        support = {title for title, _ in record.get("supporting_facts", [])}
        paragraphs = [Paragraph(title, "".join(sentences), title in support) for title, sentences in record["context"]]
        answers = [record["answer"]]
    else:
        raise ValueError("neither HotpotQA's context nor MuSiQue's paragraphs")
    if not any(p.supporting for p in paragraphs):
        raise ValueError("no supporting paragraph")
    return Question(record["question"].strip(), answers, paragraphs)


class Packer:
    """Fills each question's context to ``target`` tokens: its supporting paragraphs, its own
    distractors, then paragraphs of other questions drawn at random (seeded) until
    ``max_misses`` draws in a row do not fit."""

    def __init__(self, count_tokens, target: int, pool: list[Paragraph], seed: int, max_misses: int = 64) -> None:
        self.target, self.pool, self.rng, self.max_misses = target, pool, random.Random(seed), max_misses
        self.count_tokens = functools.lru_cache(maxsize=1 << 16)(count_tokens)

    def pack(self, question: Question) -> list[Paragraph]:
        chosen = [p for p in question.paragraphs if p.supporting]
        used = self.count_tokens(question.question) + sum(self.count_tokens(p.text) for p in chosen)
        if used > self.target:
            raise ValueError(f"supporting paragraphs exceed the target: {used} > {self.target} tokens")
        titles = {p.title for p in question.paragraphs}
        for paragraph in question.paragraphs:
            if not paragraph.supporting and used + self.count_tokens(paragraph.text) <= self.target:
                chosen.append(paragraph)
                used += self.count_tokens(paragraph.text)
        misses = 0
        while misses < self.max_misses and self.pool:
            paragraph = self.pool[self.rng.randrange(len(self.pool))]
            cost = self.count_tokens(paragraph.text)
            if paragraph.title in titles or used + cost > self.target:
                misses += 1
                continue
            # Another question's paragraph (supporting there or not) is a distractor here.
            chosen.append(replace(paragraph, supporting=False))
            titles.add(paragraph.title)
            used, misses = used + cost, 0
        self.rng.shuffle(chosen)
        return chosen


def build_row(question: Question, paragraphs: list[Paragraph], index: int, split: str) -> dict:
    documents = "\n\n".join(p.render(i + 1) for i, p in enumerate(paragraphs))
    content = f"{documents}\n\nQuestion: {question.question}\n\n{INSTRUCTION}"
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": content}], "ability": "qa",
            "answers": question.answers, "reward_model": {"style": "rule", "ground_truth": question.answers[0]},
            "extra_info": {"split": split, "index": index, "answers": question.answers,
                           "supporting": [i + 1 for i, p in enumerate(paragraphs) if p.supporting]}}


def token_counter(tokenizer: str | None):
    if tokenizer is None:
        return lambda text: len(text.split())
    from transformers import AutoTokenizer

    encode = AutoTokenizer.from_pretrained(tokenizer).encode
    return lambda text: len(encode(text, add_special_tokens=False))


def main(argv: list[str] | None = None) -> PrepReport:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", required=True, type=Path, help="HotpotQA .json or MuSiQue .jsonl")
    parser.add_argument("--target-tokens", type=int, default=32768, help="context length to pack to")
    parser.add_argument("--tokenizer", default=None, help="tokenizer counting the length (default: words)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    if not args.records.exists():
        parser.error(f"not found: {args.records}")
    questions, report = prepare_rows(args.records, lambda record, index: (index, parse(record)))
    pool = [p for _, q in questions for p in q.paragraphs]
    packer = Packer(token_counter(args.tokenizer), args.target_tokens, pool, args.seed)
    rows = []
    for index, question in questions:  # index: the record's place in the release
        try:
            rows.append(build_row(question, packer.pack(question), index, args.split))
        except ValueError as exc:
            report.withdraw(index, str(exc).split(":")[0], question.question)
    write_split(rows, args.out, args.split, report)
    return report


if __name__ == "__main__":
    main()

"""Small multi-hop QA sets in HotpotQA's and MuSiQue's public formats, with generated documents."""

from __future__ import annotations

import random


def paragraph(rng: random.Random, title: str, fact: str = "", words: tuple[int, int] = (20, 40)) -> str:
    words = [f"w{rng.randrange(500)}" for _ in range(rng.randrange(*words))]
    return " ".join(words[:10]) + (f" {fact} " if fact else " ") + " ".join(words[10:]) + "."


def hotpot_records(count: int, seed: int = 0, answer: str | None = None,
                   words: tuple[int, int] = (20, 40)) -> list[dict]:
    """Two-hop questions: "Where was the director of <film> born?" over two supporting documents
    and eight distractors of ``words`` words (``answer``: the same answer for every question)."""
    rng, records = random.Random(seed), []
    for i in range(count):
        film, person, city = f"Film{i}", f"Person{i}", answer or f"City{i % 7}"
        support = [[film, [paragraph(rng, film, f"{film} was directed by {person}.", words)]],
                   [person, [paragraph(rng, person, f"{person} was born in {city}.", words)]]]
        distractors = [[f"Other{i}_{j}", [paragraph(rng, f"Other{i}_{j}", words=words)]] for j in range(8)]
        context = support + distractors
        rng.shuffle(context)
        records.append({"_id": f"h{i}", "question": f"Where was the director of {film} born?", "answer": city,
                        "supporting_facts": [[film, 0], [person, 0]], "context": context, "type": "bridge"})
    return records


def musique_records(count: int, seed: int = 0) -> list[dict]:
    rng, records = random.Random(seed), []
    for i in range(count):
        paragraphs = [{"idx": 0, "title": f"Band{i}",
                       "paragraph_text": paragraph(rng, "", f"Band{i} was formed by Ann{i}."), "is_supporting": True},
                      {"idx": 1, "title": f"Ann{i}", "paragraph_text": paragraph(rng, "", f"Ann{i} plays the violin."),
                       "is_supporting": True}]
        paragraphs += [{"idx": 2 + j, "title": f"Noise{i}_{j}", "paragraph_text": paragraph(rng, ""),
                        "is_supporting": False} for j in range(6)]
        records.append({"id": f"m{i}", "question": f"What instrument does the founder of Band{i} play?",
                        "answer": "violin", "answer_aliases": ["the violin", "fiddle"], "paragraphs": paragraphs,
                        "answerable": True})
    return records

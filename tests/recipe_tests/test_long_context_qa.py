"""The long-context multi-hop QA recipe: EM/F1 reward with standard normalisation, and packing
HotpotQA / MuSiQue records into contexts of a target length with distractors."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from recipes.long_context_qa import prepare_data
from recipes.long_context_qa.reward import compute_score, exact_match, extract_answer, f1, reward, score

from .learning import grpo_rewards, rose_by
from .qa_data import hotpot_records, musique_records


@pytest.mark.parametrize(("completion", "answers", "expected"), [
    ("Thinking...\nAnswer: The Violin.", ["violin"], 1.0),
    ("Answer: a fiddle", ["violin", "fiddle"], 1.0),
    ("Answer: City3", "City3", 1.0),
    ("Answer: in Paris, France", ["Paris"], 2 * (1 / 3) * 1 / (1 / 3 + 1)),
    ("Answer: London", ["Paris"], 0.0),
    ("no marker\nParis", ["Paris"], 1.0),
    ("", ["Paris"], 0.0),
    # Unicode punctuation goes as ASCII's does.
    ("Answer: \u201cParis\u201d", ["Paris"], 1.0),
    ("Answer: Paris\u3002", ["Paris"], 1.0),
    ("Answer: \u00abLe Havre\u00bb \u2014 France", ["Le Havre, France"], 1.0),
])
def test_reward_cases(completion, answers, expected):
    assert score(completion, answers) == pytest.approx(expected)
    assert compute_score("multihop_qa", completion, answers) == pytest.approx(expected)


def test_the_metric_is_f1_or_em_and_nothing_else():
    assert score("Answer: in Paris", ["Paris"], metric="em") == 0.0
    assert score("Answer: in Paris", ["Paris"], metric="f1") == pytest.approx(2 / 3)
    for metric in ("F1", "exact_match", ""):
        with pytest.raises(ValueError, match=f"unknown metric {metric!r}: use one of 'f1', 'em'"):
            score("Answer: Paris", ["Paris"], metric=metric)


def test_metrics_and_trl_entry_point():
    assert exact_match("The  Eiffel tower!", "eiffel tower") == 1.0 and exact_match("Eiffel", "eiffel tower") == 0.0
    assert f1("Eiffel", "eiffel tower") == pytest.approx(2 / 3)
    assert extract_answer("a\nanswer: x\ny") == "x"
    chat = [[{"role": "assistant", "content": "Answer: violin"}], [{"role": "assistant", "content": "Answer: drum"}]]
    assert reward(chat, answers=[["violin"], ["violin"]]) == [1.0, 0.0]


def count_words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("fmt", ["hotpotqa", "musique"])
def test_prepare_packs_supporting_paragraphs_and_distractors_to_the_target(tmp_path, fmt):
    records = hotpot_records(6) if fmt == "hotpotqa" else musique_records(6)
    broken = [{"question": "Q?", "answer": ""},
              {"question": "Q?", "answer": "x", "paragraphs": [], "answerable": False},
              {"question": "Q?", "answer": "x", "context": [["T", ["text"]]], "supporting_facts": []}, 7]
    if fmt == "hotpotqa":
        source = tmp_path / "hotpot.json"
        source.write_text(json.dumps(records + broken))
    else:
        source = tmp_path / "musique.jsonl"
        source.write_text("\n".join(json.dumps(r) for r in records + broken) + "\n")
    target = 600  # the question's own paragraphs and some of other questions'
    report = prepare_data.main(["--records", str(source), "--target-tokens", str(target),
                                "--out", str(tmp_path / "out")])
    assert report.kept == 6
    assert report.rejected == {"missing answer": 1, "unanswerable": 1, "no supporting paragraph": 1,
                               "not a JSON object": 1}
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    for row, record in zip(rows, records, strict=True):
        content = row["prompt"][0]["content"]
        # The whole prompt counts: documents with their headers, the question, the instruction.
        assert target - 50 < count_words(content) <= target  # filled up to the last paragraph that fits
        documents = content.split("\n\nQuestion: ")[0].split("\n\n")
        supporting = row["extra_info"]["supporting"]
        assert len(supporting) == 2 and all(f"Document [{n}]" in content for n in supporting)
        titles = [d.split("(Title: ")[1].split(")")[0] for d in documents]
        assert any(t.startswith(("Other", "Noise")) and t[len("Other"):].split("_")[0] not in record["question"]
                   for t in titles)  # distractors of other questions too
        for answer in row["answers"]:  # aliases too, through verl's entry point
            assert compute_score("multihop_qa", f"Answer: {answer}", row["reward_model"]["ground_truth"],
                                 row["extra_info"]) == 1.0


@pytest.mark.slow
def test_the_qa_reward_rises_on_a_learnable_task(tiny_policy, tmp_path):
    """Every question's answer is 4: through TRL on Arctic, a tiny random model learns to end its
    completion with the answer (F1 rewards a last line that holds it among other words)."""
    source = tmp_path / "hotpot.json"
    source.write_text(json.dumps(hotpot_records(32, answer="4", words=(3, 6))))
    # 400 tokens of prompt: the documents, the question and the instruction.
    prepare_data.main(["--records", str(source), "--target-tokens", "400", "--tokenizer", str(tiny_policy),
                       "--out", str(tmp_path / "data")])
    # 12 tokens give a random model room to say "4" by chance early on: with 8, the first rewarded
    # sample came after 6 to 28 steps depending on the sampling seed; with 12 it rose for seeds 0-4.
    rewards = grpo_rewards(tiny_policy, reward, tmp_path / "data", tmp_path / "run", steps=40, lr=3e-3,
                           completion_tokens=12)
    print("QA F1 reward per step:", [round(r, 3) for r in rewards])
    assert rose_by(rewards, 0.1), rewards


def test_prompts_never_exceed_the_target(tmp_path, tiny_policy):
    """Many questions share a large pool of distractors: every prompt, rendered, stays within the
    target, in words and in a real tokenizer's tokens (which do not add up paragraph by paragraph)."""
    source = tmp_path / "hotpot.json"
    source.write_text(json.dumps(hotpot_records(400)))
    prepare_data.main(["--records", str(source), "--target-tokens", "4096", "--out", str(tmp_path / "words")])
    lengths = [count_words(row["prompt"][0]["content"]) for row in read_rows(tmp_path / "words")]
    assert len(lengths) == 400 and 4096 - 50 < min(lengths) and max(lengths) <= 4096
    source.write_text(json.dumps(hotpot_records(40)))
    prepare_data.main(["--records", str(source), "--target-tokens", "1024", "--tokenizer", str(tiny_policy),
                       "--out", str(tmp_path / "tokens")])
    count_tokens = prepare_data.token_counter(str(tiny_policy))
    lengths = [count_tokens(row["prompt"][0]["content"]) for row in read_rows(tmp_path / "tokens")]
    assert len(lengths) == 40 and 1024 - 150 < min(lengths) and max(lengths) <= 1024


def read_rows(folder):
    return [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]


def test_malformed_records_are_rejected_with_the_field_and_the_run_goes_on(tmp_path):
    hotpot, musique = hotpot_records(3), musique_records(3)
    hotpot[0]["supporting_facts"] = None
    hotpot[1]["context"][0][1] = "sentences, not a list"
    musique[0]["answer_aliases"] = None
    musique[1]["paragraphs"][0]["paragraph_text"] = 5
    musique[2]["question"] = 7
    (tmp_path / "hotpot.json").write_text(json.dumps(hotpot))
    (tmp_path / "musique.jsonl").write_text("\n".join(json.dumps(r) for r in musique) + "\n")
    report = prepare_data.main(["--records", str(tmp_path / "hotpot.json"), "--target-tokens", "400",
                                "--out", str(tmp_path / "hotpot")])
    assert report.kept == 1 and report.rejected == {"malformed supporting_facts": 1, "malformed context": 1}
    rejected = read_rejected(tmp_path / "hotpot")
    assert rejected[0]["reason"] == "malformed supporting_facts: expected a list, got NoneType"
    with pytest.raises(SystemExit, match="no record of .*musique.jsonl could be used"):
        prepare_data.main(["--records", str(tmp_path / "musique.jsonl"), "--out", str(tmp_path / "musique")])
    assert [r["reason"] for r in read_rejected(tmp_path / "musique")] == [
        "malformed answer_aliases: expected a list, got NoneType",
        "malformed paragraphs: a paragraph_text is not text",
        "malformed question: expected text, got int"]


def read_rejected(folder):
    return [json.loads(line) for line in (folder / "train.rejected.jsonl").read_text().splitlines()]


def test_supporting_paragraphs_longer_than_the_target_are_rejected(tmp_path):
    source = tmp_path / "hotpot.json"
    source.write_text(json.dumps(hotpot_records(2)))
    with pytest.raises(SystemExit, match="no record of .*hotpot.json could be used"):
        prepare_data.main(["--records", str(source), "--target-tokens", "80", "--out", str(tmp_path / "out")])
    reasons = [r["reason"] for r in read_rejected(tmp_path / "out")]
    alone = [count_words(prepare_data.render_prompt(q, [p for p in q.paragraphs if p.supporting]))
             for q in map(prepare_data.parse, hotpot_records(2))]
    assert reasons == [f"supporting paragraphs exceed the target: the prompt with them alone is {n} > 80 tokens"
                       for n in alone]

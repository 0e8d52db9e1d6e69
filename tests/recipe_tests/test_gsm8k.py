"""The GSM8K recipe: its reward on hand-written cases, its data preparation from the public format
(bad records counted and kept aside), and GRPO through TRL on Arctic end to end on a tiny model,
where the reward rises on a task the model can learn."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import yaml

from recipes.gsm8k import prepare_data, train_trl
from recipes.gsm8k.reward import compute_score, extract_answer, gold_answer, reward, score

from .gsm8k_data import arithmetic_records, write_release


@pytest.mark.parametrize(("completion", "reference", "expected"), [
    ("3 + 4 = 7\n#### 7", "7", 1.0),
    ("The answer is $1,200.50.", "1200.5", 1.0),
    ("So the total is \\boxed{1{,}200} dollars", "1200", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("she has 12 apples, then 5 more: the answer is 17 apples", "17", 1.0),
    ("#### 72\nbut first I counted 3", "72", 1.0),  # the #### line wins over a later number
    ("\\boxed{8} #### 9", "8", 1.0),  # and \boxed over ####
    ("it costs 50%", "50", 1.0),
    ("answer: -3 degrees", "-3", 1.0),
    ("8.00", "8", 1.0),
    ("#### 7", "8", 0.0),
    ("no number here", "3", 0.0),
    ("", "3", 0.0),
    ("\\boxed{", "3", 0.0),
    ("2/0", "2", 0.0),
    ("1,000,000", "1000000", 1.0),
])
def test_reward_cases(completion, reference, expected):
    assert score(completion, reference) == expected
    assert compute_score("openai/gsm8k", completion, reference) == expected



# Each completion tells the documented rule apart from its plausible alternatives (the first match
# instead of the last, a case-sensitive "answer is", the last number of the text instead of the
# marked one): the reward must read ``answer`` and none of ``not_these``.
@pytest.mark.parametrize(("completion", "answer", "not_these"), [
    ("\\boxed{3} was a slip; so \\boxed{5}, after 7 tries", "5", ["3", "7"]),  # the last \boxed
    ("\\boxed{\\frac{1}{2}} then \\boxed{6} of 9", "6", ["0.5", "9"]),
    ("#### 3\nrecounting the 8 boxes:\n#### 5\n(11 in all)", "5", ["3", "8", "11"]),  # the last #### line
    ("ANSWER IS 5 after 7 tries", "5", ["7"]),  # "answer is" in any case
    ("Answer: 5, from 7 apples", "5", ["7"]),
    ("The Answer Is 4. Rechecking the 9 rows, the answer is 5 of 7", "5", ["4", "9", "7"]),  # the last one
    ("#### 5\nThe answer is 4 of 7", "5", ["4", "7"]),  # #### before "answer is"
    ("The answer is 4\n\\boxed{5} of 7", "5", ["4", "7"]),  # \boxed before "answer is"
])
def test_the_final_answer_is_the_last_marked_one(completion, answer, not_these):
    assert score(completion, answer) == 1.0
    assert [score(completion, other) for other in not_these] == [0.0] * len(not_these)

@pytest.mark.parametrize(("completion", "reference", "expected"), [
    ("The answer is \u22123", "3", 0.0),  # U+2212, the minus sign
    ("The answer is \u22123", "-3", 1.0),
    # A comma separates thousands only between groups of three digits.
    ("The possible values are 1,2,3", "123", 0.0),
    ("The possible values are 1,2,3", "3", 1.0),
    ("#### 12,34", "1234", 0.0),
    ("#### 1,0000", "10000", 0.0),
    # So does a no-break, narrow no-break or thin space, one kind throughout.
    ("The answer is 1\u00a0000", "1", 0.0),
    ("The answer is 1\u00a0000", "1000", 1.0),
    ("The answer is 1\u202f234\u202f567", "1234567", 1.0),
    ("The answer is 1\u2009000.5", "1000.5", 1.0),
    ("The answer is 1,000\u00a0000", "1000000", 0.0),
    # The exponent is read.
    ("The answer is 3.0e2", "3", 0.0),
    ("The answer is 3.0e2", "300", 1.0),
    ("\\boxed{2.5E-1}", "0.25", 1.0),
    ("The answer is 1e99999999999", "1", 0.0),  # too large to compute, not a misread 1
    # A time of day is not a number answer.
    ("The answer is 2:30 pm", "2", 0.0),
    ("The answer is 2:30 pm", "30", 0.0),
    ("#### 14:05:10", "14", 0.0),
    ("We leave at 2:30 pm, so the answer is 45 minutes", "45", 1.0),
    ("The ratio is 3:2, so the answer is 2", "2", 1.0),
])
def test_number_forms(completion, reference, expected):
    assert score(completion, reference) == expected


def test_reward_entry_points_take_trls_and_verls_shapes():
    chat = [[{"role": "assistant", "content": "#### 5"}], [{"role": "assistant", "content": "six"}]]
    assert reward(chat, answer=["5", "6"]) == [1.0, 0.0]
    assert reward(["#### 5"], answer=["5"], prompts=["q"], trainer_state=None) == [1.0]
    assert extract_answer("a 1 b 2") == "2" and gold_answer("x\n#### 1,234") == "1234"


def test_prepare_data_counts_and_keeps_bad_records(tmp_path):
    broken = ["not json", json.dumps({"question": "Q?", "answer": "no marker"}),
              json.dumps({"question": "Q?", "answer": "#### seven"}), json.dumps({"answer": "#### 3"}),
              json.dumps([1, 2])]
    source = write_release(tmp_path / "gsm8k", arithmetic_records(6), arithmetic_records(3, seed=1), broken)
    reports = prepare_data.main(["--source", str(source), "--out", str(tmp_path / "out")])
    train = reports["train"]
    assert train.kept == 6 and sum(train.rejected.values()) == 5
    assert train.rejected == {"not a JSON object": 2, "no '####' in the answer": 1,
                              "the answer after '####' is not a number": 1, "no question": 1}
    rejected = [json.loads(line) for line in (tmp_path / "out" / "train.rejected.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rejected] == [6, 7, 8, 9, 10]
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    first = arithmetic_records(6)[0]
    assert rows[0]["prompt"][0]["content"].startswith(first["question"])
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": first["answer"].split("#### ")[1]}
    assert reports["test"].kept == 3 and not reports["test"].rejected


def cpu_config(tmp_path, steps: int, **trl) -> str:
    """The recipe's H200 config with what a CPU run changes (fp32, no checkpointing, small lengths)."""
    config = yaml.safe_load(train_trl.DEFAULT_CONFIG.read_text())
    config["trl"].update(max_steps=steps, bf16=False, use_cpu=True, gradient_checkpointing=False,
                         max_completion_length=8, report_to="none", save_strategy="no", **trl)
    config["arctic"] = {"sampler": {"backend": "embedded"}, "trainer": {"options": {"zero_stage": 2}}}
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow
def test_trl_recipe_runs_end_to_end_on_a_tiny_model(tiny_policy, tmp_path):
    source = write_release(tmp_path / "gsm8k", arithmetic_records(16), arithmetic_records(4, seed=1))
    prepare_data.main(["--source", str(source), "--out", str(tmp_path / "data")])
    trainer = train_trl.main(["--model", str(tiny_policy), "--data", str(tmp_path / "data"), "--out",
                              str(tmp_path / "run"), "--config", cpu_config(tmp_path, steps=2),
                              "--set", "trl.gradient_accumulation_steps=2", "--set", "trl.save_strategy=no"])
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert len(history) == 2 and all("arctic/loss" in h for h in history)
    assert trainer.arctic.status().policy_version == 2


@pytest.mark.slow
def test_the_gsm8k_reward_rises_on_a_learnable_task(tiny_policy, tmp_path):
    """Every question's answer is 4: a tiny random model learns to end its answer with 4."""
    source = write_release(tmp_path / "gsm8k", arithmetic_records(64, answer=4), arithmetic_records(4, seed=1))
    prepare_data.main(["--source", str(source), "--out", str(tmp_path / "data")])
    trainer = train_trl.main(["--model", str(tiny_policy), "--data", str(tmp_path / "data"), "--out",
                              str(tmp_path / "run"), "--config", cpu_config(tmp_path, steps=16, learning_rate=3e-3),
                              "--set", "trl.per_device_train_batch_size=16",
                              "--set", "trl.gradient_accumulation_steps=1"])
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.1, rewards


def test_an_override_outside_the_configs_sections_is_refused(tmp_path):
    """``--set max_steps=2`` (no section) would be silently ignored by TRL's config: it is refused."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trl": {"max_steps": 5}, "arctic": {}}))
    assert train_trl.load_config(config, ["trl.max_steps=2"])["trl"]["max_steps"] == 2
    for item in ("max_steps=2", "trainer.max_steps=2"):
        with pytest.raises(SystemExit,
                           match=r"the key must start with one of the config's sections \(arctic\., trl\.\)"):
            train_trl.load_config(config, [item])

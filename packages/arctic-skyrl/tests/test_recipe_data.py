"""The recipes' ``prepare_data --format skyrl`` files load through SkyRL's own PromptDataset, and
each row's environment (skyrl-gym's ``gsm8k``, or one ``recipes.skyrl_env`` registers) scores a
right answer 1 and a wrong one 0 from the extras the dataset hands it."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import pytest
import skyrl_gym
from skyrl.train.dataset import PromptDataset
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # the recipes run from the repository root

from recipes import skyrl_env  # noqa: E402
from recipes.gsm8k import prepare_data as gsm8k  # noqa: E402
from recipes.long_context_qa import prepare_data as long_context_qa  # noqa: E402
from recipes.text_to_sql import prepare_data as text_to_sql  # noqa: E402


def load(path: Path, policy: Path) -> list[tuple]:
    """Every item of SkyRL's PromptDataset over ``path``: (messages, env_class, extras, uid)."""
    dataset = PromptDataset([str(path)], AutoTokenizer.from_pretrained(policy), max_prompt_length=4096, num_workers=1)
    return [dataset[i] for i in range(len(dataset))]


def rewards(item: tuple, answers: list[str]) -> list[float]:
    """The reward of each answer, from the environment SkyRL's generator makes for ``item``."""
    messages, env_class, extras, _ = item
    scores = []
    for answer in answers:
        env = skyrl_gym.make(env_class, env_config={}, extras=extras)
        env.init(messages)
        scores.append(env.step(answer)["reward"])
    return scores


def test_gsm8k_rows_are_scored_by_skyrl_gyms_gsm8k_environment(policy, tmp_path):
    records = [{"question": f"What is {a} + {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a:,}"}
               for a in range(500, 520)]
    source = tmp_path / "problems.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    gsm8k.main(["--source", str(source), "--test-size", "5", "--format", "skyrl", "--out", str(tmp_path / "out")])
    items = (load(tmp_path / "out" / "train.skyrl.parquet", policy)
             + load(tmp_path / "out" / "test.skyrl.parquet", policy))
    assert len(items) == len(records)
    for messages, env_class, extras, _ in items:
        question = records[extras["extra_info"]["index"]]["question"]
        assert env_class == "gsm8k" and messages[0]["role"] == "user" and messages[0]["content"].startswith(question)
    for item in items[:3]:
        gold = 2 * int(records[item[2]["extra_info"]["index"]]["question"].split()[2])  # written "1,000" in the data
        assert rewards(item, [f"so #### {gold}", f"so #### {gold:,}", f"so #### {gold + 1}"]) == [1.0, 1.0, 0.0]


def test_a_gsm8k_answer_with_a_currency_sign_is_still_matched(policy, tmp_path):
    source = tmp_path / "problems.jsonl"
    source.write_text(2 * (json.dumps({"question": "How much?", "answer": "3 x 400\n#### $1,200"}) + "\n"))
    gsm8k.main(["--source", str(source), "--test-size", "1", "--format", "skyrl", "--out", str(tmp_path / "out")])
    [item] = load(tmp_path / "out" / "train.skyrl.parquet", policy)
    assert rewards(item, ["#### 1200", "#### 1,200", "#### 1300"]) == [1.0, 1.0, 0.0]


def test_text_to_sql_rows_are_scored_by_the_recipes_reward(policy, tmp_path):
    database = tmp_path / "databases" / "shop" / "shop.sqlite"
    database.parent.mkdir(parents=True)
    with sqlite3.connect(database) as db:
        db.execute("CREATE TABLE item (id INTEGER, price INTEGER)")
        db.executemany("INSERT INTO item VALUES (?, ?)", [(i, i * 10) for i in range(8)])
    records = tmp_path / "train.json"
    records.write_text(json.dumps([{"db_id": "shop", "question": "How many items cost over 30?", "evidence": "",
                                    "SQL": "SELECT count(*) FROM item WHERE price > 30"}]))
    text_to_sql.main(["--records", str(records), "--databases", str(tmp_path / "databases"), "--format", "skyrl",
                      "--out", str(tmp_path / "out")])
    skyrl_env.register()
    [item] = load(tmp_path / "out" / "train.skyrl.parquet", policy)
    assert item[1] == "text_to_sql"
    assert rewards(item, ["```sql\nSELECT count(id) FROM item WHERE price >= 40\n```",
                          "```sql\nSELECT count(*) FROM item\n```"]) == [1.0, 0.0]


def test_long_context_qa_rows_are_scored_by_the_recipes_reward(policy, tmp_path):
    record = {"question": "Where was the director of Film0 born?", "answer": "Lima",
              "supporting_facts": [["Film0", 0], ["Ann", 0]],
              "context": [["Film0", ["Film0 was directed by Ann."]], ["Ann", ["Ann was born in Lima."]],
                          ["Other", ["Nothing to see here."]]]}
    (tmp_path / "hotpot.json").write_text(json.dumps([record]))
    long_context_qa.main(["--records", str(tmp_path / "hotpot.json"), "--target-tokens", "200", "--format", "skyrl",
                          "--out", str(tmp_path / "out")])
    skyrl_env.register()
    [item] = load(tmp_path / "out" / "train.skyrl.parquet", policy)
    assert item[1] == "long_context_qa" and "Ann was born in Lima." in item[0][0]["content"]
    assert rewards(item, ["She was born there.\nAnswer: Lima", "Answer: Paris"]) == [1.0, 0.0]


@pytest.mark.parametrize("env_class", sorted(skyrl_env.SCORERS))
def test_registering_twice_is_harmless(env_class):
    skyrl_env.register()
    skyrl_env.register()
    assert env_class in skyrl_gym.envs.registration.registry

"""The recipes through verl on Arctic: each recipe's data, prepared from its public format by its
own script, and each recipe's reward, in one ``main_ppo`` run of two GRPO steps on a tiny model
(validation reports a score per recipe); and every recipe YAML's dry run (verl's config composed
as main_ppo composes it, the start-up checks, every problem reported at once, the engines placed
on the cluster)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from recipes import launch  # noqa: E402
from recipes.gsm8k import prepare_data as gsm8k_prep  # noqa: E402
from recipes.long_context_qa import prepare_data as qa_prep  # noqa: E402
from recipes.text_to_sql import prepare_data as sql_prep  # noqa: E402
from verl_run import logged_steps, main_ppo_args, run_main_ppo  # noqa: E402


def recipe_test_module(name: str):
    """A helper module of the recipes' own tests (tests/recipe_tests), by its file."""
    spec = importlib.util.spec_from_file_location(f"recipe_tests_{name}",
                                                  ROOT / "tests" / "recipe_tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gsm8k_data, qa_data, sql_data = (recipe_test_module(n) for n in ("gsm8k_data", "qa_data", "sql_data"))

RECIPE_REWARD = Path(__file__).with_name("recipe_reward.py")
YAMLS = sorted(ROOT.glob("recipes/*/verl_*.yaml"))


def prepared_rows(tmp_path: Path) -> list[dict]:
    """One row per recipe, each written by the recipe's own preparation script."""
    gsm8k = gsm8k_data.write_release(tmp_path / "gsm8k", gsm8k_data.arithmetic_records(1),
                                     gsm8k_data.arithmetic_records(1, seed=1))
    gsm8k_prep.main(["--source", str(gsm8k), "--out", str(tmp_path / "gsm8k_out")])
    sql_data.make_database(tmp_path / "bird_db" / "concert" / "concert.sqlite", rows=30)
    bird = tmp_path / "bird.json"
    bird.write_text(json.dumps([{"db_id": "concert", "question": "How many singers are from Peru?", "evidence": "",
                                 "SQL": sql_data.GOLD}]))
    sql_prep.main(["--records", str(bird), "--databases", str(tmp_path / "bird_db"),
                   "--out", str(tmp_path / "sql_out")])
    hotpot = tmp_path / "hotpot.json"
    hotpot.write_text(json.dumps(qa_data.hotpot_records(1)))
    qa_prep.main(["--records", str(hotpot), "--target-tokens", "130", "--out", str(tmp_path / "qa_out")])
    frames = [pd.read_parquet(tmp_path / folder / "train.parquet") for folder in ("gsm8k_out", "sql_out", "qa_out")]
    return [row for frame in frames for row in frame[["data_source", "prompt", "ability", "reward_model",
                                                       "extra_info"]].to_dict("records")]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_each_recipes_data_and_reward_train_through_verl_on_arctic(policy, tmp_path):
    rows = prepared_rows(tmp_path)
    assert [r["data_source"] for r in rows] == ["openai/gsm8k", "bird", "multihop_qa"]
    data = tmp_path / "recipes.parquet"
    pd.DataFrame(rows).to_parquet(data)
    extra = (f"reward.custom_reward_function.path={RECIPE_REWARD}", "reward.custom_reward_function.name=compute_score",
             "data.max_prompt_length=448", "trainer.test_freq=2", "data.filter_overlong_prompts=False")
    args = main_ppo_args(policy, data, data, tmp_path, steps=2, batch=3, n=2, response_length=16, extra=extra)
    result = run_main_ppo(args, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    steps = logged_steps(result.stdout + result.stderr)
    assert sorted(steps) == [1, 2]
    assert all(metrics["arctic/train/tokens"] > 0 for metrics in steps.values())
    validated = {key.split("/")[1] for key in steps[2] if key.startswith("val-core/")}
    assert {"openai", "bird", "multihop_qa"} <= validated, sorted(steps[2])


@pytest.fixture
def recipe_home(tmp_path, monkeypatch) -> Path:
    """A home holding every recipe's data files where its YAML names them (``~/data/...``; empty:
    the dry run checks that they exist), and the engines' packages taken as installed, as on the
    clusters the recipes are for (this environment has no vLLM)."""
    from arctic_core.plugins import registry

    home = tmp_path / "home"
    for path in YAMLS:
        for key in launch.DATA_KEYS:
            data = home / yaml.safe_load(path.read_text())["verl"][key].removeprefix("~/")
            data.parent.mkdir(parents=True, exist_ok=True)
            data.touch()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(registry, "unmet_requirements", lambda needs: [])
    return home


@pytest.mark.usefixtures("recipe_home")
@pytest.mark.parametrize("path", YAMLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_yamls_dry_run(path, capsys):
    assert launch.main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    recipe = yaml.safe_load(path.read_text())
    gpus = recipe["cluster"]["nodes"] * recipe["cluster"]["gpus_per_node"]
    assert f"placement on {recipe['cluster']['nodes']} nodes" in out and "command:" in out
    assert f"reward.custom_reward_function.path={ROOT / recipe['reward']}" in out
    used = sum(float(line.split("GPUs")[0].split(":")[1].split("/")[0]) for line in out.splitlines()
               if line.strip().startswith("node "))
    assert used == gpus  # the 32-GPU recipes use every GPU, the 1-GPU one its GPU


@pytest.mark.usefixtures("recipe_home")
def test_dry_run_refuses_what_does_not_fit_or_verl_cannot_honour(tmp_path):
    recipe = yaml.safe_load((ROOT / "recipes/text_to_sql/verl_32gpu.yaml").read_text())
    recipe["cluster"]["nodes"] = 3
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit, match="the engines need 32 GPUs .* the cluster has 3 x 8"):
        launch.main([str(small), "--dry-run"])
    with pytest.raises(SystemExit, match="actor_rollout_ref.model.lora_rank=8: Arctic trains full weights"):
        launch.main([str(ROOT / "recipes/gsm8k/verl_1gpu.yaml"), "--dry-run",
                     "--set", "actor_rollout_ref.model.lora_rank=8"])


def dry_run(capsys, path: Path, *sets: str) -> tuple[str, list[str]]:
    """The dry run's plan and its command's items."""
    assert launch.main([str(path), "--dry-run", *(arg for item in sets for arg in ("--set", item))]) == 0
    plan, _, command = capsys.readouterr().out.partition("command: ")
    return plan, command.split()


@pytest.mark.usefixtures("recipe_home")
def test_dry_run_plans_on_the_cluster_the_command_names(capsys):
    plan, command = dry_run(capsys, ROOT / "recipes/gsm8k/verl_1gpu.yaml", "trainer.n_gpus_per_node=2")
    assert "placement on 1 nodes x 2 GPUs" in plan and "node 0: 1/2 GPUs" in plan
    assert [item for item in command if item.startswith("trainer.n_gpus_per_node=")] == ["trainer.n_gpus_per_node=2"]
    with pytest.raises(SystemExit, match="the engines need 32 GPUs .* the cluster has 1 x 8"):
        launch.main([str(ROOT / "recipes/text_to_sql/verl_32gpu.yaml"), "--dry-run", "--set", "trainer.nnodes=1"])


@pytest.mark.usefixtures("recipe_home")
@pytest.mark.parametrize("key", ["arctic.config.trainer.options.zero_stage",
                                 "+arctic.config.trainer.options.zero_stage", "arctic.trainer.options.zero_stage"])
def test_dry_run_takes_arctic_keys_in_verls_spelling_or_the_recipes(capsys, key):
    plan, command = dry_run(capsys, ROOT / "recipes/gsm8k/verl_1gpu.yaml", f"{key}=3", "arctic.num_gpus=0.5")
    assert "trainer: deepspeed {'zero_stage': 3}" in plan and "server[0]:0.5" in plan
    assert [item for item in command if item.startswith("+arctic.config.trainer.")] == [
        "+arctic.config.trainer.options.zero_stage=3"]
    assert "+arctic.num_gpus=0.5" in command


def test_an_override_verl_refuses_is_one_line():
    with pytest.raises(SystemExit) as refused:
        launch.main([str(ROOT / "recipes/gsm8k/verl_1gpu.yaml"), "--dry-run", "--set", "data.max_prompt_lenght=512"])
    assert str(refused.value) == ("verl's config refused an override: Could not override 'data.max_prompt_lenght'. "
                                  "To append to your config use +data.max_prompt_lenght=512 "
                                  "(Key 'max_prompt_lenght' is not in struct)")


GSM8K = ROOT / "recipes/gsm8k/verl_1gpu.yaml"
FITTING = ("data.max_prompt_length=256", "data.max_response_length=256")  # the tiny policy has 512 positions


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.mark.usefixtures("recipe_home")
@pytest.mark.parametrize(("items", "named"), [
    (("actor_rollout_ref.model.path=/nonexistent/model",),
     "actor_rollout_ref.model.path: '/nonexistent/model' does not exist"),
    ((), "data.max_response_length unless set) = 1536 tokens, more than the model's max_position_embeddings=512"),
    (("data.train_files=/nonexistent/train.parquet", *FITTING),
     "data.train_files: '/nonexistent/train.parquet' does not exist"),
], ids=["missing-model", "lengths-past-positions", "missing-data"])
def test_dry_run_refuses_what_main_ppo_would_naming_the_setting(policy, items, named):
    with pytest.raises(SystemExit) as refused:
        launch.main([str(GSM8K), "--dry-run", *sets(f"actor_rollout_ref.model.path={policy}", *items)])
    assert str(refused.value).startswith("the dry run found 1 problem(s)") and named in str(refused.value)


@pytest.mark.usefixtures("recipe_home")
def test_dry_run_passes_a_good_config(policy, capsys):
    assert launch.main([str(GSM8K), "--dry-run", *sets(f"actor_rollout_ref.model.path={policy}", *FITTING)]) == 0
    out = capsys.readouterr().out
    assert f"model: {policy}" in out and "node 0: 1/1 GPUs" in out and "note:" not in out


def test_dry_run_reports_every_problem_at_once_and_writes_nothing(policy, tmp_path):
    """As a user runs it, from a folder of their own: one exit, each problem named, no traceback;
    nothing written there or into the checkout (no Hydra outputs/)."""
    here = tmp_path / "cwd"
    here.mkdir()
    had_outputs = (ROOT / "outputs").exists()
    items = (f"actor_rollout_ref.model.path={policy}", "data.train_files=/nonexistent/train.parquet",
             "data.val_files=[/nonexistent/val.parquet]", "reward.custom_reward_function.path=/nonexistent/reward.py",
             "actor_rollout_ref.model.lora_rank=8", "trainer.n_gpus_per_node=3", "arctic.trainer.options.zero_stge=1")
    done = subprocess.run([sys.executable, "-m", "recipes.launch", str(GSM8K), "--dry-run", *sets(*items)], cwd=here,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    named = ["max_position_embeddings=512", "data.train_files: '/nonexistent/train.parquet'",
             "data.val_files: '/nonexistent/val.parquet'",
             "reward.custom_reward_function.path: '/nonexistent/reward.py'",
             "lora_rank=8: Arctic trains full weights",
             "verl's config check: real_train_batch_size (512) must be divisible by minimal possible batch size (3)",
             "trainer.options.zero_stge: unknown key"]
    assert f"the dry run found {len(named)} problem(s)" in done.stderr, done.stderr[-3000:]
    assert all(name in done.stderr for name in named), done.stderr[-3000:]
    assert list(here.iterdir()) == [] and (ROOT / "outputs").exists() == had_outputs

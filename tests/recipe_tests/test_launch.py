"""The verl recipes' launcher, where it needs no verl: what ``--set`` changes in a recipe and the
command it makes, the dry run's checks of the model, the lengths, the data and the reward file,
and the one-line answer of an environment without verl. Dry runs, which compose verl's config,
are tested in verl's environment (packages/arctic-verl/tests/test_recipes.py)."""

from __future__ import annotations

import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

from recipes import launch

ROOT = Path(__file__).resolve().parents[2]
SQL_RECIPE, GSM8K_RECIPE = ROOT / "recipes/text_to_sql/verl_32gpu.yaml", ROOT / "recipes/gsm8k/verl_1gpu.yaml"


def command_items(recipe: dict, prefix: str) -> list[str]:
    return [item for item in launch.overrides(recipe) if item.startswith(prefix)]


def test_set_nodes_and_gpus_per_node_change_the_cluster_the_placement_reads():
    recipe = launch.load(SQL_RECIPE, ["trainer.nnodes=1"])
    assert recipe["cluster"] == {"nodes": 1, "gpus_per_node": 8} and "trainer.nnodes" not in recipe["verl"]
    assert command_items(recipe, "trainer.nnodes=") == ["trainer.nnodes=1"]  # once, not 4 and then 1
    recipe = launch.load(GSM8K_RECIPE, ["trainer.n_gpus_per_node=2"])
    assert recipe["cluster"] == {"nodes": 1, "gpus_per_node": 2}
    assert command_items(recipe, "trainer.n_gpus_per_node=") == ["trainer.n_gpus_per_node=2"]
    assert launch.load(SQL_RECIPE, ["cluster.nodes=2"])["cluster"]["nodes"] == 2


@pytest.mark.parametrize("value", ["0", "two", "1.5", "true"])
def test_a_cluster_size_must_be_a_positive_whole_number(value):
    with pytest.raises(SystemExit, match=r"cluster.nodes \(verl's trainer.nnodes\) must be a positive whole number"):
        launch.load(SQL_RECIPE, [f"trainer.nnodes={value}"])


def test_a_recipe_setting_the_cluster_in_its_verl_section_is_refused(tmp_path):
    recipe = yaml.safe_load(GSM8K_RECIPE.read_text())
    recipe["verl"]["trainer.n_gpus_per_node"] = 4
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit, match="set cluster.gpus_per_node instead of verl's trainer.n_gpus_per_node"):
        launch.load(path, [])


@pytest.mark.parametrize("key", ["arctic.config.trainer.options.zero_stage",
                                 "+arctic.config.trainer.options.zero_stage"])
def test_set_an_arctic_key_edits_the_recipes_arctic_section(key):
    recipe = launch.load(GSM8K_RECIPE, [f"{key}=3"])
    assert recipe["arctic"]["trainer"] == {"options": {"zero_stage": 3}}
    assert not any("arctic" in k for k in recipe["verl"])
    assert command_items(recipe, "+arctic.config.trainer.") == ["+arctic.config.trainer.options.zero_stage=3"]
    recipe = launch.load(GSM8K_RECIPE, ["arctic.config.reference={}", "arctic.config.model.dtype=float32"])
    assert recipe["arctic"]["reference"] == {} and recipe["arctic"]["model"] == {"dtype": "float32"}


@pytest.mark.parametrize(("item", "problem"), [
    ("arctic.config.sampler.backend.x=1", r"arctic.sampler.backend is 'embedded', not a mapping"),
    ("arctic.config=1", r"name a key inside arctic"),
    ("arctic_server.=1", r"name a key inside arctic_server"),
    ("data.train_files=[a", r"the value '\[a' is not valid YAML"),
])
def test_a_set_that_cannot_apply_is_one_clear_error(item, problem):
    with pytest.raises(SystemExit, match=problem):
        launch.load(GSM8K_RECIPE, [item])


@pytest.mark.skipif(find_spec("verl") is not None, reason="this environment has verl")
def test_without_verl_the_launcher_names_the_environment_to_use():
    done = subprocess.run([sys.executable, "-m", "recipes.launch", str(GSM8K_RECIPE), "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("recipes.launch needs verl and arctic-verl") and ".venv-verl" in done.stderr


def startup(policy: Path, data: Path, **changes: object) -> dict[str, object]:
    """The settings the dry run checks, all well (the tiny policy's 512 positions fit 256 + 256;
    a relative reward path is read from the repository root; a remote file is verl's to copy)."""
    return {launch.MODEL_KEY: str(policy), launch.PROMPT_KEY: 256, launch.RESPONSE_KEY: 256,
            "data.train_files": str(data), "data.val_files": [str(data), "hdfs://cluster/val.parquet"],
            launch.REWARD_KEY: "recipes/gsm8k/reward.py", **changes}


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"")
    return path


def test_the_start_up_checks_pass_a_good_config(tiny_policy, data):
    assert launch.startup_problems(startup(tiny_policy, data)) == ([], [])


@pytest.mark.parametrize(("changes", "named"), [
    ({launch.MODEL_KEY: "/nonexistent/model"}, "actor_rollout_ref.model.path: '/nonexistent/model' does not exist"),
    ({launch.PROMPT_KEY: 512, launch.RESPONSE_KEY: 1024},
     "data.max_prompt_length + data.max_response_length unless set) = 1536 tokens, more than the model's "
     "max_position_embeddings=512"),
    ({"data.train_files": "/nonexistent/train.parquet"},
     "data.train_files: '/nonexistent/train.parquet' does not exist"),
    ({"data.val_files": ["data/missing.parquet"]},
     f"data.val_files: 'data/missing.parquet' does not exist (read from {ROOT})"),
    ({launch.REWARD_KEY: "/nonexistent/reward.py"},
     "reward.custom_reward_function.path: '/nonexistent/reward.py' does not exist"),
], ids=["model", "lengths", "train-file", "val-file", "reward-file"])
def test_each_start_up_problem_names_its_setting_value_and_fix(tiny_policy, data, changes, named):
    problems, notes = launch.startup_problems(startup(tiny_policy, data, **changes))
    assert len(problems) == 1 and named in problems[0] and not notes, problems
    assert any(fix in problems[0] for fix in ("--set", "lower them", "model folder")), problems


def test_every_start_up_problem_is_reported_at_once(tiny_policy, data):
    problems, _ = launch.startup_problems(startup(
        tiny_policy, data, **{launch.RESPONSE_KEY: 1024, "data.train_files": "/nonexistent/train.parquet",
                              "data.val_files": ["/nonexistent/a.parquet", str(data), "/nonexistent/b.parquet"],
                              launch.REWARD_KEY: "/nonexistent/reward.py"}))
    named = ["max_position_embeddings=512", "data.train_files", "'/nonexistent/a.parquet'", "'/nonexistent/b.parquet'",
             "reward.custom_reward_function.path"]
    assert len(problems) == len(named) and all(any(n in p for p in problems) for n in named), problems
    problems, _ = launch.startup_problems(startup(tiny_policy, data, **{launch.MODEL_KEY: "/nonexistent/model",
                                                                        "data.train_files": "/nonexistent/t.parquet"}))
    assert [p.split(":")[0] for p in problems] == ["actor_rollout_ref.model.path", "data.train_files"]


def test_a_model_folder_without_config_json_is_refused(tmp_path, data):
    problems, _ = launch.startup_problems(startup(tmp_path, data))
    assert problems == [f"actor_rollout_ref.model.path: {str(tmp_path)!r} has no config.json; it must be a local "
                        "Hugging Face model folder (the save_pretrained layout; `arctic-rl tiny-model DIR` writes a "
                        "tiny one to try things with) or a model id on the Hugging Face Hub"]


def test_a_hub_model_id_not_in_the_cache_is_the_runs_to_fetch(tiny_policy, data, monkeypatch):
    """The dry run downloads nothing: an uncached Hub id is a note (the run fetches it), unless the
    Hub is switched off, where the run could not fetch it either."""
    from huggingface_hub import constants

    hub = {launch.MODEL_KEY: "arctic-rl-tests/no-such-model"}
    problems, notes = launch.startup_problems(startup(tiny_policy, data, **hub))
    assert problems == [] and len(notes) == 1
    assert notes[0].startswith("actor_rollout_ref.model.path: 'arctic-rl-tests/no-such-model' is no local folder")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    problems, notes = launch.startup_problems(startup(tiny_policy, data, **hub))
    assert len(problems) == 1 and problems[0].startswith("actor_rollout_ref.model.path: nothing is at") and not notes

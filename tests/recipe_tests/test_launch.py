"""The verl recipes' launcher, where it needs no verl: what ``--set`` changes in a recipe and the
command it makes, and the one-line answer of an environment without verl. Dry runs, which compose
verl's config, are tested in verl's environment (packages/arctic-verl/tests/test_recipes.py)."""

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

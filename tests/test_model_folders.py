"""Model paths: local folders, and Hugging Face Hub model ids served from the Hub's cache.

No machine here reaches the Hub, so the Hub's side is its cache: a snapshot laid out as
huggingface_hub writes one (``models--org--name/refs/main`` naming ``snapshots/<commit>``), read
with downloads off. Fetching fills the same layout, and the same call finds it.
"""

from __future__ import annotations

import shutil

import pytest

from arctic_core.adapters.preflight import check_positions
from arctic_core.client import ArcticClient
from arctic_core.config import ArcticConfig
from arctic_core.errors import ArcticError, ConfigError
from arctic_core.model_folders import cached_model_folder, hub_id
from arctic_core.serving.checkpoint_folders import HF_EXPORT, STATE_FILE

PROMPTS = [[5, 6, 7], [8, 9]]


def test_a_hub_model_id_is_served_from_its_snapshot_as_its_folder_is(hub_cache, tiny_policy):
    served, tokens = {}, {}
    for path in ("arctic-test/tiny-policy", str(tiny_policy)):
        client = ArcticClient.in_process({"model": {"path": path, "device": "cpu"}, "trainer": {"backend": "torch"},
                                          "seed": 0})
        try:
            served[path] = client.status().info["config"]["model"]["path"]
            tokens[path] = client.generate(PROMPTS, n=2, max_tokens=4, seed=3).batch.response_ids.tolist()
        finally:
            client.close()
    assert served == {"arctic-test/tiny-policy": str(hub_cache), str(tiny_policy): str(tiny_policy)}
    assert tokens["arctic-test/tiny-policy"] == tokens[str(tiny_policy)]
    config = ArcticConfig.from_dict({"model": {"path": "arctic-test/tiny-policy"}}).with_local_models()
    assert config.model.path == str(hub_cache)  # every engine is handed the snapshot folder
    assert cached_model_folder("arctic-test/tiny-policy") == str(hub_cache)


def test_adapters_check_a_hub_models_positions_from_its_snapshot(hub_cache):
    check_positions("arctic-test/tiny-policy", 16, "max_len")
    with pytest.raises(ArcticError, match="max_len = 100000 tokens, more than the model's max_position_embeddings"):
        check_positions("arctic-test/tiny-policy", 100_000, "max_len")
    check_positions("arctic-test/not-cached", 100_000, "max_len")  # not here: the folder checks report it


def test_a_hub_model_that_cannot_be_fetched_is_one_error_naming_the_setting(hub_cache, tiny_policy):
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy)},
                                     "reference": {"model": {"path": "arctic-test/absent"}}})
    with pytest.raises(ConfigError, match=r"^reference.model.path: nothing is at 'arctic-test/absent' here, and "
                       r"fetching it as a model id from the Hugging Face Hub failed: \w+"):
        config.with_local_models()
    assert cached_model_folder("arctic-test/absent") is None


def test_local_paths_are_never_taken_for_hub_ids(tmp_path, tiny_policy):
    (tmp_path / "empty").mkdir()
    checkpoint, exported = tmp_path / "ckpt", tmp_path / "exported"
    checkpoint.mkdir()
    (checkpoint / STATE_FILE).write_text("{}")
    shutil.copytree(checkpoint, exported)
    shutil.copytree(tiny_policy, exported / HF_EXPORT)
    for path, why in ((tmp_path / "absent", "does not exist"), (tmp_path / "empty", "has no config.json"),
                      (checkpoint,
                       "is an Arctic checkpoint saved without export_hf=True, so it holds no model folder .*"),
                      (exported, f"is an Arctic checkpoint .*; its model folder is '{exported / HF_EXPORT}'")):
        with pytest.raises(ConfigError, match=f"model.path: '{path}' {why}; it must be a local Hugging Face model "
                           "folder .* or a model id on the Hugging Face Hub"):
            ArcticConfig.from_dict({"model": {"path": str(path)}}).with_local_models()
    local = ArcticConfig.from_dict({"model": {"path": str(tiny_policy)}}).with_local_models()
    assert local.model.path == str(tiny_policy)
    assert [hub_id(p) for p in ("Qwen/Qwen3-1.7B", "gpt2", "./models/qwen", "a/b/c", str(tiny_policy))] == [
        "Qwen/Qwen3-1.7B", "gpt2", None, None, None]


def test_a_server_started_from_a_hub_id_is_the_frameworks_model_for_the_adapters_check(hub_cache, tiny_policy,
                                                                                         tmp_path):
    """A framework naming the Hub id talks to a server that loaded its snapshot: the same model. A
    server of another model is still refused."""
    from arctic_core.adapters.preflight import check_server
    from arctic_core.adapters.settings import BackendSettings
    from arctic_core.serving.http import create_app
    from arctic_core.serving.server import ArcticServer
    from test_http import LiveServer

    server = ArcticServer(ArcticConfig.from_dict({"model": {"path": "arctic-test/tiny-policy", "device": "cpu"},
                                                  "trainer": {"backend": "torch"}}))
    live = LiveServer(create_app(server))
    try:
        check_server(BackendSettings(url=live.url), "arctic-test/tiny-policy", "model.name", None)
        other = shutil.copytree(tiny_policy, tmp_path / "other")
        with pytest.raises(ArcticError, match=f"serves {hub_cache}, but model.name is {other}"):
            check_server(BackendSettings(url=live.url), str(other), "model.name", None)
    finally:
        live.stop()

"""Weight-sync transports: safetensors files through the real client, and a two-process gloo broadcast."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from arctic_core.client import ArcticClient
from arctic_core.config import WeightSyncConfig
from arctic_core.errors import ConfigError
from arctic_core.plugins.registry import default_registry
from arctic_core.ports import free_port
from arctic_core.weights.files import MANIFEST, WeightFilesError, load_weight_files, read_manifest, write_weight_files

PROMPTS = [[1, 20, 30, 40, 2], [1, 50, 60, 2], [1, 70, 2]]
BUCKET_BYTES = 64 * 1024  # small, so the tiny model spans several files


def server_of(client: ArcticClient):
    return client.transport.server


def trained_client(arctic_config, **weight_sync) -> ArcticClient:
    config = arctic_config(trainer={"backend": "torch", "optimizer": {"lr": 1e-2}},
                           weight_sync={"transport": "safetensors-files", "bucket_bytes": BUCKET_BYTES, **weight_sync})
    client = ArcticClient.in_process(config)
    batch = client.generate(PROMPTS, n=2, max_tokens=4, seed=7).batch
    rewards = torch.linspace(-1, 1, batch.num_responses)
    old = client.log_probs(batch).outputs["logprobs"]
    client.fwd_bwd(batch.replace(old_logprobs=old, advantages=rewards, rewards=rewards), "ppo")
    client.step()
    return client


def test_safetensors_files_move_the_sampler_to_the_trainer(arctic_config, tmp_path):
    with trained_client(arctic_config, options={"dir": str(tmp_path / "sync")}) as client:
        trained = {k: v.clone() for k, v in server_of(client).trainer.named_weights()}
        sampler_state = server_of(client).sampler.model.state_dict()
        assert any(not torch.equal(sampler_state[k], v) for k, v in trained.items())

        result = client.sync_weights()
        assert result.policy_version == 1 and result.metrics["files"] > 1 and result.metrics["bytes"] > 0
        for name, tensor in trained.items():
            assert torch.equal(sampler_state[name], tensor), name
        assert client.generate(PROMPTS[:1], n=2, max_tokens=2).batch.policy_version.tolist() == [1, 1]

        manifest = read_manifest(tmp_path / "sync")
        assert manifest["version"] == 1 and len(manifest["files"]) == result.metrics["files"]
        assert manifest["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}  # tied, written once
        version, on_disk = load_weight_files(tmp_path / "sync")
        assert version == 1 and {k: v for k, v in on_disk}.keys() == trained.keys()
        for file in manifest["files"]:
            assert (tmp_path / "sync" / file["path"]).stat().st_size <= BUCKET_BYTES + 4096 or len(file["tensors"]) == 1

        assert client.sync_weights().policy_version == 2
        assert read_manifest(tmp_path / "sync")["version"] == 2
        assert client.generate(PROMPTS[:1], n=1, max_tokens=2).batch.policy_version.tolist() == [2]


def test_default_dir_is_a_temp_folder_per_server(arctic_config):
    with trained_client(arctic_config) as client:
        assert client.sync_weights().metrics["files"] > 1
        folder = server_of(client).weight_transport.dir
        assert read_manifest(folder)["version"] == 1 and folder.name.startswith("arctic-weights-")


@pytest.mark.parametrize(("transport", "options", "message"), [
    ("inprocess", {"dirr": "/x"}, "weight_sync.options.dirr: unknown key"),
    ("safetensors-files", {"dirr": "/x"}, "weight_sync.options.dirr: unknown key (did you mean 'dir'?)"),
    ("torch-broadcast", {"backend": "ncl"}, "weight_sync.options.backend: Input should be 'gloo' or 'nccl'"),
    ("cuda-ipc", {"backend": "nccl"}, "weight_sync.options.backend: unknown key"),
])
def test_every_transport_refuses_options_it_does_not_take(transport, options, message):
    config = WeightSyncConfig(transport=transport, options=options)
    with pytest.raises(ConfigError, match=re.escape(message)):
        default_registry().get("weight_transport", transport)(config)


def test_tied_tensors_are_written_once_and_loaded_under_both_names(tmp_path):
    embed = torch.randn(8, 4)
    weights = [("embed.weight", embed), ("head.weight", embed), ("half", embed[:4]), ("bias", torch.ones(4))]
    manifest = write_weight_files(tmp_path, weights, version=3, bucket_bytes=1 << 20)
    assert manifest["aliases"] == {"head.weight": "embed.weight"}
    version, loaded = load_weight_files(tmp_path)
    loaded = dict(loaded)
    assert version == 3 and loaded.keys() == {"embed.weight", "head.weight", "half", "bias"}
    for name, tensor in weights:
        assert torch.equal(loaded[name], tensor), name


def test_a_torn_version_is_refused_before_any_tensor_is_read(tmp_path):
    write_weight_files(tmp_path, [(f"w{i}", torch.randn(64, 64)) for i in range(4)], version=5, bucket_bytes=20_000)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert len(manifest["files"]) == 4
    (tmp_path / manifest["files"][2]["path"]).unlink()
    with pytest.raises(WeightFilesError,
                       match=r"torn weight sync: version 5 names .*00002\.safetensors, which is missing"):
        load_weight_files(tmp_path)


def test_a_truncated_file_and_a_missing_manifest_are_refused(tmp_path):
    with pytest.raises(WeightFilesError, match="no weights published"):
        load_weight_files(tmp_path)
    manifest = write_weight_files(tmp_path, [("w", torch.randn(16, 16))], version=1, bucket_bytes=1 << 20)
    path = tmp_path / manifest["files"][0]["path"]
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(WeightFilesError, match="torn weight sync: .* bytes, the manifest says"):
        load_weight_files(tmp_path)


def test_old_versions_are_pruned_and_the_previous_one_kept(tmp_path):
    for version in range(1, 5):
        write_weight_files(tmp_path, [("w", torch.full((4,), float(version)))], version=version, bucket_bytes=1 << 20)
    folders = sorted(p.name[:9] for p in tmp_path.iterdir() if p.is_dir())
    assert folders == ["v00000003", "v00000004"]
    version, loaded = load_weight_files(tmp_path)
    assert version == 4 and torch.equal(dict(loaded)["w"], torch.full((4,), 4.0))


# --------------------------------------------------------------------------- two-process broadcast
WORKER = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import save_file
    from arctic_core.weights.broadcast import (WeightGroup, broadcast_weights, plan_broadcast, receive_broadcast,
                                               share_plan)

    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    group = WeightGroup.join("127.0.0.1", port, rank, 2, "gloo")
    if rank == 0:
        torch.manual_seed(0)
        embed = torch.randn(300, 16)
        weights = [("embed.weight", embed), ("lm_head.weight", embed), ("norm.weight", torch.rand(16)),
                   ("layer.0.w", torch.randn(64, 32).to(torch.bfloat16)), ("layer.1.w", torch.randn(40, 40)),
                   ("step", torch.tensor([7], dtype=torch.int64))]
        plan = plan_broadcast(weights, bucket_bytes=8192, version=4)
        share_plan(group, plan)
        broadcast_weights(group, weights, plan)
        got = {n: t.clone() for n, t in weights}
    else:
        plan = share_plan(group)
        got = {n: t.clone() for n, t in receive_broadcast(group, plan)}
    group.close()
    save_file(got, out, metadata={"version": str(plan["version"]), "buckets": str(len(plan["buckets"]))})
""")


def test_broadcast_moves_weights_between_two_processes_over_gloo(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    outs = [tmp_path / f"rank{rank}.safetensors" for rank in (0, 1)]
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(port), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, out in enumerate(outs)]
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, output
    sent, received = load_file(outs[0]), load_file(outs[1])
    assert sent.keys() == received.keys() and len(sent) == 6
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    from safetensors import safe_open

    with safe_open(outs[1], framework="pt") as f:
        meta = f.metadata()
    assert meta["version"] == "4" and int(meta["buckets"]) > 3  # several buckets, fp32/bf16/int64 apart

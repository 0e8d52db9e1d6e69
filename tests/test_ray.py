"""The ``ray`` training backend on a real local Ray cluster: two DeepSpeed ranks (gloo, CPU) give
the update of one rank on the same global batch; a dead worker is reported by rank."""

from __future__ import annotations

import pytest
import torch

from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient
from arctic_core.errors import WorkerError
from arctic_core.config import TrainerConfig
from arctic_core.http_server import _health
from arctic_core.ray_trainer import ray_environment, ray_trainer_config

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
PPO = [{"name": "ppo", "old_logprobs": "current"}, {"name": "entropy", "weight": 0.01}]
# Adam with a large eps moves each weight in proportion to its gradient, so comparing updates
# compares gradients (with the default eps the first step is ~lr * sign(grad), blind to them).
OPTIMIZER = {"lr": 1e-2, "eps": 1.0}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray_environment()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def grpo_batch(vocab: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (9, 14, 6, 11, 7)]
    responses, index = [], []
    for p in range(len(prompts)):
        for _ in range(3):
            length = int(torch.randint(2, 9, (1,), generator=gen))
            responses.append(torch.randint(3, vocab, (length,), generator=gen).tolist())
            index.append(p)
    batch = RolloutBatch.from_lists(prompts, responses, index)
    return batch.replace(advantages=torch.randn(batch.num_responses, generator=gen))


def run(config: dict, steps: int = 2) -> tuple[list[float], dict[str, torch.Tensor], ArcticClient]:
    client = ArcticClient.in_process(config)
    server = client.transport.server
    batch = grpo_batch(server.sampler.model.config.vocab_size)
    losses = []
    for _ in range(steps):
        losses.append(client.fwd_bwd(batch, PPO).metrics["loss"])
        client.step()
        client.sync_weights()
    return losses, dict(server.trainer.named_weights()), client


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ray_ranks_give_the_update_of_one(tiny_policy, stage):
    base = {"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0}
    deepspeed = {"backend": "deepspeed", "optimizer": OPTIMIZER, "options": {"zero_stage": stage}}
    one_losses, one_weights, one = run({**base, "trainer": deepspeed})
    one.close()
    ray_trainer = {"backend": "ray", "optimizer": OPTIMIZER,
                   "options": {"workers": 2, "backend": "deepspeed", "options": {"zero_stage": stage}}}
    two_losses, two_weights, two = run({**base, "trainer": ray_trainer})
    assert two_losses == pytest.approx(one_losses, abs=1e-5)
    for name, weight in one_weights.items():
        assert torch.allclose(two_weights[name], weight, atol=1e-6, rtol=1e-5), name
    # The sampler follows the two-rank trainer.
    sampler = two.transport.server.sampler.model.state_dict()
    assert all(torch.equal(sampler[name], tensor) for name, tensor in two_weights.items())
    two.close()


def test_a_dead_worker_is_named_and_a_checkpoint_restarts_the_workers(tiny_policy, tmp_path):
    config = {"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
              "trainer": {"backend": "ray", "optimizer": OPTIMIZER, "options": {"workers": 2, "backend": "deepspeed"}}}
    with ArcticClient.in_process(config) as client:
        server = client.transport.server
        batch = grpo_batch(server.sampler.model.config.vocab_size)
        client.fwd_bwd(batch, PPO)
        client.step()
        client.save_checkpoint(str(tmp_path / "ckpt"))
        expected_loss = client.fwd_bwd(batch, PPO).metrics["loss"]  # the next step's loss, from the checkpoint
        client.step()
        ray.kill(server.trainer.workers[1])
        with pytest.raises(WorkerError, match="training worker rank 1 died during fwd_bwd"):
            client.fwd_bwd(batch, PPO)
        assert client.status().step == 2  # still answering
        health = _health(server, busy=False)
        assert health["status"] == "degraded" and health["engines"]["trainer"]["dead_ranks"] == [1]
        client.load_checkpoint(str(tmp_path / "ckpt"))  # restarts both ranks and restores them
        assert _health(server, busy=False)["status"] == "ok" and client.status().step == 1
        assert client.fwd_bwd(batch, PPO).metrics["loss"] == pytest.approx(expected_loss, abs=1e-6)


def test_serve_ray_wraps_the_configured_trainer():
    trainer = TrainerConfig(backend="deepspeed", options={"zero_stage": 2})
    wrapped = ray_trainer_config(trainer, workers=4, address="ray://head:10001")
    assert wrapped.backend == "ray"
    assert wrapped.options == {"workers": 4, "backend": "deepspeed", "options": {"zero_stage": 2},
                               "address": "ray://head:10001"}
    assert ray_trainer_config(wrapped, workers=2).options["workers"] == 2

"""The ``ray`` training backend on a real local Ray cluster: two DeepSpeed ranks (gloo, CPU) give
the update of one rank on the same global batch; a dead worker is reported by rank."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from arctic_core.client import ArcticClient, AsyncArcticClient
from arctic_core.errors import ConfigError, PluginNotFoundError, WorkerError
from arctic_core.config import ArcticConfig, TrainerConfig
from arctic_core.serving.http import _health
from arctic_core.ray.actors import ray_environment
from arctic_core.ray.trainer import ray_trainer_config, split_by_groups
from helpers import random_grpo_batch, weights

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


@pytest.fixture(scope="module")
def config(tiny_policy):
    return ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
                                   "trainer": {"backend": "torch"}, "reference": {"backend": "torch"}})


def run(config: dict, steps: int = 2) -> tuple[list[float], dict[str, torch.Tensor], ArcticClient]:
    client = ArcticClient.in_process(config)
    server = client.transport.server
    batch = random_grpo_batch(server.sampler.model.config.vocab_size)
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


@pytest.mark.timeout(600)  # before the fix, the rank with fewer micro-batches left the other hanging
def test_zero3_ranks_with_unequal_micro_batch_counts_run_in_step(tiny_policy):
    """A small token budget gives one rank three micro-batches and the other two; under ZeRO-3
    every forward is a collective, so the lighter rank runs an idle pass (loss x 0) and the
    update still equals one rank's."""
    from arctic_zorro.micro_batches import plan_micro_batches

    base = {"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0}
    options = {"zero_stage": 3}
    one_losses, one_weights, one = run({**base, "trainer": {"backend": "deepspeed", "optimizer": OPTIMIZER,
                                                          "options": options, "micro_batch_tokens": 40}})
    batch = random_grpo_batch(one.transport.server.sampler.model.config.vocab_size)
    one.close()
    counts = [len(plan_micro_batches(batch.select(rows), 40, grouped=True)) for rows in split_by_groups(batch, 2)]
    assert counts[0] != counts[1], counts  # the case under test
    ray_trainer = {"backend": "ray", "optimizer": OPTIMIZER, "micro_batch_tokens": 40,
                   "options": {"workers": 2, "backend": "deepspeed", "options": options}}
    two_losses, two_weights, two = run({**base, "trainer": ray_trainer})
    two.close()
    assert two_losses == pytest.approx(one_losses, abs=1e-5)
    for name, weight in one_weights.items():
        assert torch.allclose(two_weights[name], weight, atol=1e-6, rtol=1e-5), name


def test_a_worker_killed_mid_fwd_bwd_is_named_and_a_checkpoint_restores_every_rank(tiny_policy, tmp_path):
    config = {"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
              "trainer": {"backend": "ray", "optimizer": OPTIMIZER, "micro_batch_tokens": 48,
                          "options": {"workers": 2, "backend": "deepspeed"}}}
    with ArcticClient.in_process(config) as client:
        server = client.transport.server
        vocab = server.sampler.model.config.vocab_size
        batch = random_grpo_batch(vocab)
        client.fwd_bwd(batch, PPO)
        client.step()
        client.save_checkpoint(str(tmp_path / "ckpt"))
        expected_loss = client.fwd_bwd(batch, PPO).metrics["loss"]  # the next step's loss, from the checkpoint
        client.step()
        trainer, gather = server.trainer, server.trainer._gather

        def rank_1_dies_inside_the_call(refs, what):
            # Once every rank's task is submitted (not after a fixed time, which a fast CPU outruns).
            trainer._gather = gather
            ray.kill(trainer.workers[1])
            return gather(refs, what)

        trainer._gather = rank_1_dies_inside_the_call
        with pytest.raises(WorkerError, match="training worker rank 1 died during fwd_bwd") as info:
            client.fwd_bwd(batch, PPO)
        assert "load_checkpoint restarts the workers" in str(info.value)
        assert client.status().step == 2  # still answering
        health = _health(server)
        assert health["status"] == "degraded" and health["engines"]["trainer"]["dead_ranks"] == [1]
        client.load_checkpoint(str(tmp_path / "ckpt"))  # restarts both ranks and restores them
        assert _health(server)["status"] == "ok" and client.status().step == 1
        assert client.fwd_bwd(batch, PPO).metrics["loss"] == pytest.approx(expected_loss, abs=1e-6)
        assert client.step().metrics["grad_norm"] > 0


@pytest.mark.parametrize("stage", [2, 3])
def test_fewer_prompt_groups_than_ranks_give_the_update_of_one(tiny_policy, stage):
    """A rank with no prompt group joins the collectives with a zero-weighted pass: it adds no
    gradient, and DeepSpeed's step (and ZeRO-3's gathers) see every rank."""
    base = {"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0}
    updates = []
    for trainer in ({"backend": "deepspeed", "optimizer": OPTIMIZER, "options": {"zero_stage": stage}},
                    {"backend": "ray", "optimizer": OPTIMIZER,
                     "options": {"workers": 2, "backend": "deepspeed", "options": {"zero_stage": stage}}}):
        with ArcticClient.in_process({**base, "trainer": trainer}) as client:
            one_group = random_grpo_batch(client.transport.server.sampler.model.config.vocab_size, groups=(9,))
            loss = client.fwd_bwd(one_group, PPO).metrics["loss"]
            client.step()
            updates.append((loss, weights(client)))
    (one_loss, one), (two_loss, two) = updates
    assert two_loss == pytest.approx(one_loss, abs=1e-6)
    for name, weight in one.items():
        assert torch.allclose(two[name], weight, atol=1e-6, rtol=1e-5), name


def test_random_call_sequences_leave_the_next_update_exact_on_ray_ranks(tiny_policy, tmp_path):
    from test_robustness import OPS, TRAINER, assert_sequence_leaves_the_update_exact

    ops = {name: op for name, op in OPS.items() if name != "failing_fwd_bwd"}  # its loss exists in this process only
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0, "trainer": {
        **TRAINER, "backend": "ray", "options": {"workers": 2, "backend": "deepspeed", "options": {"zero_stage": 2}}}})
    assert_sequence_leaves_the_update_exact(config, tmp_path, seed=5, calls=25, make_client=ArcticClient.in_process,
                                            ops=ops)


def test_serve_ray_wraps_the_configured_engines():
    from arctic_core.cli import ray_config

    config = ArcticConfig.from_dict({"model": {"path": "policy"},
                                     "trainer": {"backend": "deepspeed", "options": {"zero_stage": 2}},
                                     "sampler": {"backend": "embedded", "options": {"block_size": 32}}})
    served = ray_config(config, workers=4, samplers=2, address="ray://head:10001")
    assert served.trainer.backend == "ray" and served.sampler.backend == "ray"
    assert served.trainer.options == {"workers": 4, "backend": "deepspeed", "options": {"zero_stage": 2},
                                      "address": "ray://head:10001"}
    assert served.sampler.options == {"replicas": 2, "backend": "embedded", "options": {"block_size": 32},
                                      "address": "ray://head:10001"}
    assert served.weight_sync.transport == "torch-broadcast"
    assert ray_trainer_config(served.trainer, workers=2).options["workers"] == 2
    in_server = ray_config(config, workers=2, samplers=0, address=None)
    assert in_server.sampler.backend == "embedded" and in_server.weight_sync.transport == "inprocess"


# ----------------------------------------------------------------- the Ray transport
def test_grpo_through_the_ray_transport_equals_in_process(config):
    """The demo's GRPO loop against the server as a Ray actor: the same numbers as in process."""
    from test_http import assert_same_loop, grpo_loop

    in_process = ArcticClient.in_process(config)
    expected = grpo_loop(in_process)
    in_process.shutdown()
    # The same thread count as this process: float sums then run in the same order.
    with ArcticClient.ray(config, name="arctic-loop", num_cpus=torch.get_num_threads()) as client:
        assert_same_loop(expected, grpo_loop(client))


def test_ray_clients_connect_by_name_keep_hundreds_of_calls_apart_and_see_errors(config):
    from test_http import load_prompt

    owner = ArcticClient.ray(config, name="arctic-shared")
    other = ArcticClient.ray(name="arctic-shared")  # any process of the cluster: connect by name
    assert other.status().policy_version == 0
    with pytest.raises(PluginNotFoundError, match="no-such-loss"):
        other.fwd_bwd(owner.generate([[1, 5, 6]], n=2, max_tokens=3).batch, "no-such-loss")
    # Hundreds of concurrent calls from one event loop: none lost, none swapped.
    results = asyncio.run(_gather_generate(AsyncArcticClient.ray(name="arctic-shared"), 200))
    assert [r.batch.prompt(0) for r in results] == [load_prompt(i) for i in range(200)]
    assert all(r.batch.num_responses == 1 and int(r.batch.response_lens[0]) == 1 for r in results)
    ray.kill(owner.transport.actor)
    assert "'arctic-shared' died" in str(_first_worker_error(other.status))
    with pytest.raises(WorkerError, match="no Arctic server actor named 'nobody'"):
        ArcticClient.ray(name="nobody")
    with pytest.raises(WorkerError, match="asks for 64 GPU"):  # Ray would wait for them forever
        ArcticClient.ray(config, name="arctic-greedy", num_gpus=64)


def _first_worker_error(call, seconds: float = 30.0) -> WorkerError:
    """``ray.kill`` returns before the actor is gone (a call made at once can still be served):
    call until the death shows, within a deadline."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            call()
        except WorkerError as error:
            return error
        time.sleep(0.1)
    raise AssertionError(f"the killed actor still answered after {seconds} s")


async def _gather_generate(client, calls: int) -> list:
    from test_http import load_prompt

    return await asyncio.gather(*(client.generate([load_prompt(i)], n=1, max_tokens=1, seed=i) for i in range(calls)))


# ----------------------------------------------------------------- sampler replicas and weight sync
PROMPTS = [[1, 20, 30, 40, 2], [1, 50, 60, 2], [1, 70, 2], [1, 9, 8, 7, 6, 5, 2]]


def greedy_reference(policy, weights: dict[str, torch.Tensor], prompts: list[list[int]],
                     tokens: int) -> list[list[int]]:
    """transformers' greedy generate with the given weights: what every replica must produce."""
    from transformers import AutoModelForCausalLM

    from arctic_core.hf import copy_weights_

    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    copy_weights_(model, weights.items())
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("transport", ["torch-broadcast", "inprocess"])
def test_sampler_replicas_follow_the_trainer_through_each_weight_transport(tiny_policy, transport):
    """A Ray trainer rank and two Ray sampler replicas: after a step and a sync, every replica's
    greedy output is transformers' greedy output with the trainer's new weights."""
    config = {"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
              "trainer": ray_trainer_config(TrainerConfig(backend="torch", optimizer={"lr": 0.05}),
                                            workers=1).model_dump(),
              "sampler": {"backend": "ray", "options": {"replicas": 2, "backend": "embedded"}},
              "weight_sync": {"transport": transport}}
    with ArcticClient.in_process(config) as client:
        greedy = {"n": 1, "temperature": 0.0, "max_tokens": 5}
        before = client.generate(PROMPTS, **greedy).batch
        assert before.prompt_index.tolist() == [0, 1, 2, 3]
        sampled = client.generate(PROMPTS, n=3, max_tokens=4).batch  # both replicas, joined in prompt order
        assert sampled.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
        assert [sampled.prompt(i) for i in (0, 3, 6, 9)] == PROMPTS
        batch = sampled.replace(advantages=torch.linspace(-1, 1, sampled.num_responses))
        client.fwd_bwd(batch, PPO)
        client.step()
        sync = client.sync_weights()
        assert sync.policy_version == 1 and sync.metrics["bytes"] > 0
        client.sleep(["sampler"])  # the replicas free their KV caches and park their weights...
        client.wake(["sampler"])  # ...and come back with the synced weights
        after = client.generate(PROMPTS, **greedy).batch
        weights = dict(client.transport.server.trainer.named_weights())
    assert after.policy_version.tolist() == [1] * 4
    got = [after.response(i) for i in range(4)]
    assert got != [before.response(i) for i in range(4)]  # the step changed what greedy decoding picks
    assert got == greedy_reference(tiny_policy, weights, PROMPTS, 5)


def test_split_prompts_balances_tokens_over_replicas():
    from arctic_core.ray.sampler import split_prompts

    assert split_prompts([[1] * 10] * 4, 2, new_tokens=10) == [(0, 2), (2, 4)]
    assert split_prompts([[1] * 100, [1], [1], [1]], 2, new_tokens=1) == [(0, 1), (1, 4)]
    assert split_prompts([[1]], 3, new_tokens=5) == [(0, 1), (1, 1), (1, 1)]


def test_a_reference_engine_in_its_own_actor_answers_like_the_in_process_one(config):
    """``reference: {backend: ray}``: the frozen reference model runs in an actor of its own."""
    remote = config.model_copy(update={"reference": config.reference.model_copy(
        update={"backend": "ray", "options": {"backend": "torch"}})})
    local = ArcticClient.in_process(config)
    with ArcticClient.in_process(remote) as client:
        batch = local.generate(PROMPTS, n=2, max_tokens=5).batch
        want = local.log_probs(batch, model="reference", processors=["logprobs", "entropy"]).outputs
        got = client.log_probs(batch, model="reference", processors=["logprobs", "entropy"]).outputs
        for name in ("logprobs", "entropy"):
            # Another process: its own thread count.
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0)
        client.sleep(["reference"])
        client.wake(["reference"])
        ray.kill(client.transport.server.reference.worker)
        error = _first_worker_error(lambda: client.log_probs(batch, model="reference"))
        assert "log-prob engine actor died during log_probs" in str(error)
    local.shutdown()


def test_actor_weight_transports_refuse_engines_they_cannot_serve(tiny_policy):
    """cuda-ipc needs the trainer's weights on a GPU; both actor transports need actor engines."""
    model = {"path": str(tiny_policy), "device": "cpu"}
    actors = {"model": model, "trainer": ray_trainer_config(TrainerConfig(backend="torch"), workers=1).model_dump(),
              "sampler": {"backend": "ray", "options": {"replicas": 1, "backend": "embedded"}},
              "weight_sync": {"transport": "cuda-ipc"}}
    with ArcticClient.in_process(actors) as client:
        with pytest.raises(ConfigError, match="'cuda-ipc' needs the trainer's weights on a CUDA device"):
            client.sync_weights()
        assert client.generate(PROMPTS, n=1, max_tokens=2).batch.num_responses == 4  # still serving
    for transport in ("cuda-ipc", "torch-broadcast"):
        local = {"model": model, "trainer": {"backend": "torch"}, "weight_sync": {"transport": transport}}
        with ArcticClient.in_process(local) as client:
            with pytest.raises(ConfigError, match=f"'{transport}' needs engines in Ray actors.*TorchTrainer"):
                client.sync_weights()


def test_actors_ray_cannot_place_are_refused_with_the_resource_named(tiny_policy, monkeypatch):
    """Ray would queue them forever (and the server would wait on them): a GPU share on a cluster
    without GPUs, or more CPUs than the cluster has, is a clear error at start."""
    from arctic_core.ray import actors

    model = {"path": str(tiny_policy), "device": "cpu"}
    gpus = {"model": model, "trainer": {"backend": "ray", "options": {"workers": 2, "gpus_per_worker": 0.5,
                                                                       "backend": "torch"}}}
    with pytest.raises(ConfigError, match=r"the ray trainer: 2 actor\(s\) x 0.5 GPU need 1 GPUs, 0 in the Ray cluster"):
        ArcticClient.in_process(gpus)
    cpus = {"model": model, "sampler": {"backend": "ray", "options": {"replicas": 3, "cpus_per_replica": 2,
                                                                      "backend": "embedded"}}}
    with pytest.raises(ConfigError, match=r"the ray sampler: 3 actor\(s\) x 2 CPU need 6 CPUs, 4 in the Ray cluster"):
        ArcticClient.in_process(cpus)
    # A cluster this process started frees only what it holds: what is free now counts.
    monkeypatch.setattr(actors, "_local_cluster", True)
    actors.require_resources(ray, "two actors", 2, 2.0, 0.0)  # the 4 CPUs, once earlier tests' actors are gone
    with pytest.raises(ConfigError,
                       match=r"five actors: 5 actor\(s\) x 1 CPU need 5 CPUs, [0-4] free in the local Ray"):
        actors.require_resources(ray, "five actors", 5, 1.0, 0.0, settle_s=0.5)


def test_nccl_is_refused_for_ranks_without_a_gpu_of_their_own():
    from arctic_core.ray.trainer import RayTrainerOptions

    with pytest.raises(ValueError, match="comm_backend 'nccl' needs gpus_per_worker >= 1"):
        RayTrainerOptions(workers=2, gpus_per_worker=0.5, comm_backend="nccl")
    assert RayTrainerOptions(workers=2, gpus_per_worker=0.5).resolved_comm_backend == "gloo"
    assert RayTrainerOptions(workers=2, gpus_per_worker=1).resolved_comm_backend == "nccl"
    assert RayTrainerOptions(workers=2).resolved_comm_backend == "gloo"

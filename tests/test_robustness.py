"""Any sequence of calls, in any order, leaves the server usable and its next update exact.

Random sequences of the client's calls (valid ones, refused ones, a fwd_bwd that fails half-way,
a step with nothing to apply, sleep/wake in any order, loads of missing checkpoints, ...) run
against each training backend. Afterwards the next normal update must equal the update of a fresh
server that loads the same state: no call left hidden state (a partial gradient, a broken
optimizer, an engine asleep) behind.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from arctic_core.client import ArcticClient
from arctic_core.config import ArcticConfig
from arctic_core.errors import ArcticError, BatchError, ConfigError, PluginNotFoundError, RequestError
from arctic_core.plugins.hookspecs import hookimpl
from arctic_core.losses.policy import PPOLoss
from arctic_core.plugins.registry import build_registry
from arctic_core.serving.server import ArcticServer
from arctic_core.transports.inprocess import InProcessTransport
from helpers import PROMPTS, random_grpo_batch, server_of, weights

LOSS = [{"name": "ppo", "clip_low": 0.2, "clip_high": 0.28}, {"name": "entropy", "weight": 0.01}]
# Adam with a large eps moves each weight in proportion to its gradient, so equal updates mean
# equal gradients (with the default eps the first step is ~lr * sign(grad)).
TRAINER = {"micro_batch_tokens": 40, "optimizer": {"lr": 1e-2, "eps": 1.0}}
BACKENDS = {
    "torch": {"backend": "torch"},
    "deepspeed-zero0": {"backend": "deepspeed", "options": {"zero_stage": 0}},
    "deepspeed-zero2": {"backend": "deepspeed", "options": {"zero_stage": 2}},
    "deepspeed-zero3": {"backend": "deepspeed", "options": {"zero_stage": 3}},
}


class FailsMidway(PPOLoss):
    """PPO that raises on the second micro-batch that carries gradients: the first one's gradient
    has been added by then, as when an engine fails part-way through a call."""

    error: type[Exception] = RuntimeError

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.graded_calls = 0

    def __call__(self, outputs, batch, ctx):
        if outputs["logprobs"].requires_grad:
            self.graded_calls += 1
            if self.graded_calls == 2:
                raise self.error("the engine failed half-way through fwd_bwd")
        return super().__call__(outputs, batch, ctx)


class RefusesMidway(FailsMidway):
    """The same failure as a refusal (a term checking the model's outputs): a gradient was added all
    the same."""

    error = BatchError


class FaultPlugin:
    @hookimpl
    def arctic_losses(self):
        return {"fails_midway": FailsMidway, "refuses_midway": RefusesMidway}


def build_client(config: ArcticConfig) -> ArcticClient:
    return ArcticClient(InProcessTransport(ArcticServer(config, build_registry({"faults": FaultPlugin()}))))


@dataclass
class Session:
    client: ArcticClient
    tmp: Path
    rng: random.Random
    saved: list[str] = field(default_factory=list)

    @property
    def batch(self):
        return random_grpo_batch(server_of(self.client).sampler.model.config.vocab_size)


def bad_fwd_bwd(s: Session) -> None:
    """A call the server must refuse before touching a gradient."""
    batch = s.batch
    call = s.rng.choice([
        lambda: s.client.fwd_bwd(batch.replace(old_logprobs=None), "ppo"),  # missing field
        lambda: s.client.fwd_bwd(batch, "pp0"),  # unknown loss
        lambda: s.client.fwd_bwd(batch, {"name": "ppo", "clip_lo": 0.2}),  # bad option
        lambda: s.client.fwd_bwd(batch.replace(advantages=torch.ones(2)), "ppo"),  # wrong shape
    ])
    with pytest.raises((BatchError, PluginNotFoundError, ConfigError)):
        call()


def failing_fwd_bwd(s: Session) -> None:
    with pytest.raises((RuntimeError, RequestError), match="half-way|asleep"):
        s.client.fwd_bwd(s.batch, "fails_midway")


def save(s: Session) -> None:
    path = str(s.tmp / f"ckpt-{len(s.saved)}")
    s.client.save_checkpoint(path)
    s.saved.append(path)


def load_missing(s: Session) -> None:
    with pytest.raises(RequestError, match="not an Arctic checkpoint"):
        s.client.load_checkpoint(str(s.tmp / "missing"))


def engines(s: Session) -> list[str] | None:
    return s.rng.choice([["trainer"], ["sampler"], ["trainer", "sampler"], None])


OPS: dict[str, Callable[[Session], Any]] = {
    "fwd_bwd": lambda s: s.client.fwd_bwd(s.batch, LOSS, scale=s.rng.choice([1.0, 0.5])),
    "bad_fwd_bwd": bad_fwd_bwd,
    "failing_fwd_bwd": failing_fwd_bwd,
    "step": lambda s: s.client.step(),
    "sleep": lambda s: s.client.sleep(engines(s)),
    "wake": lambda s: s.client.wake(engines(s)),
    "sync_weights": lambda s: s.client.sync_weights(),
    "save_checkpoint": save,
    "load_checkpoint": lambda s: s.client.load_checkpoint(s.rng.choice(s.saved)) if s.saved else None,
    "load_missing": load_missing,
    "log_probs": lambda s: s.client.log_probs(s.batch),
    "generate": lambda s: s.client.generate(PROMPTS, n=2, max_tokens=3),
    "status": lambda s: s.client.status(),
}


def run_random_calls(client: ArcticClient, tmp: Path, seed: int, calls: int,
                     ops: dict[str, Callable] = OPS) -> list[str]:
    """``calls`` random operations; a refusal (an Arctic error, e.g. an engine asleep) is a valid
    answer, any other exception fails the test. Returns the sequence, for the failure message."""
    session = Session(client, tmp, random.Random(seed))
    names = list(ops)
    done = []
    for _ in range(calls):
        name = session.rng.choice(names)
        done.append(name)
        try:
            ops[name](session)
        except ArcticError:
            pass
    return done


def next_update(client: ArcticClient, tmp: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """Wake everything, apply what is pending, save, then one normal update: (checkpoint, weights)."""
    client.wake()
    client.step()
    checkpoint = str(tmp / "before-update")
    client.save_checkpoint(checkpoint)
    batch = random_grpo_batch(server_of(client).sampler.model.config.vocab_size, seed=1)
    client.fwd_bwd(batch, LOSS)
    assert client.step().metrics["grad_norm"] > 0
    return checkpoint, weights(client)


def assert_sequence_leaves_the_update_exact(config: ArcticConfig, tmp: Path, seed: int, calls: int,
                                            make_client=build_client, ops: dict[str, Callable] = OPS) -> None:
    with make_client(config) as client:
        sequence = run_random_calls(client, tmp, seed, calls, ops)
        checkpoint, updated = next_update(client, tmp)
    with make_client(config) as fresh:
        fresh.load_checkpoint(checkpoint)
        batch = random_grpo_batch(server_of(fresh).sampler.model.config.vocab_size, seed=1)
        fresh.fwd_bwd(batch, LOSS)
        fresh.step()
        expected = weights(fresh)
    for name, tensor in expected.items():
        assert torch.equal(updated[name], tensor), f"{name} differs after {sequence}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_random_call_sequences_leave_the_next_update_exact(backend, tiny_policy, tmp_path):
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
                                     "trainer": {**TRAINER, **BACKENDS[backend]}})
    assert_sequence_leaves_the_update_exact(config, tmp_path, seed=list(BACKENDS).index(backend), calls=40)


@pytest.mark.parametrize("backend", ["torch", "deepspeed-zero2"])
def test_step_without_gradients_is_a_no_op(backend, tiny_policy):
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
                                     "trainer": {**TRAINER, **BACKENDS[backend],
                                                 "scheduler": {"name": "linear", "warmup_steps": 2, "total_steps": 9}}})
    with build_client(config) as client:
        before = weights(client)
        for _ in range(2):
            metrics = client.step().metrics
            assert metrics["skipped"] == 1.0 and metrics["grad_norm"] == 0.0 and metrics["step"] == 0.0
        assert all(torch.equal(before[k], v) for k, v in weights(client).items())
        client.fwd_bwd(random_grpo_batch(server_of(client).sampler.model.config.vocab_size), LOSS)
        metrics = client.step().metrics
        # The schedule did not move: the first real step runs at the first warm-up LR.
        assert metrics["skipped"] == 0.0 and metrics["step"] == 1.0 and metrics["lr"] == pytest.approx(0.5e-2)


@pytest.mark.parametrize("backend", ["torch", "deepspeed-zero0", "deepspeed-zero2"])
def test_a_step_over_non_finite_gradients_or_an_empty_batch_changes_nothing(backend, tiny_policy):
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
                                     "trainer": {**TRAINER, **BACKENDS[backend],
                                                 "scheduler": {"name": "linear", "warmup_steps": 2, "total_steps": 9}}})
    with build_client(config) as client, build_client(config) as clean:
        batch = random_grpo_batch(server_of(client).sampler.model.config.vocab_size)
        before = weights(client)
        client.fwd_bwd(batch.select([]), LOSS)  # no response: nothing ran, nothing to apply
        assert client.step().metrics["skipped"] == 1.0
        outputs = client.log_probs(batch.select([]), processors=["logprobs", "entropy"]).outputs
        assert {name: tuple(t.shape) for name, t in outputs.items()} == {"logprobs": (0, 0), "entropy": (0, 0)}
        # A NaN gradient, as an overflow inside the model gives: the step is skipped (every backend,
        # every ZeRO stage) and the gradients are dropped.
        hook = next(server_of(client).trainer.model.parameters()).register_hook(lambda grad: grad * float("nan"))
        client.fwd_bwd(batch, LOSS)
        hook.remove()
        metrics = client.step(lr=0.5).metrics  # a framework's rate for a step that is skipped: not kept
        assert metrics["skipped"] == 1.0 and metrics["step"] == 0.0 and not math.isfinite(metrics["grad_norm"])
        assert all(torch.equal(before[k], v) for k, v in weights(client).items())
        for each in (client, clean):
            each.fwd_bwd(batch, LOSS)
            metrics = each.step().metrics
            assert metrics["skipped"] == 0.0 and metrics["step"] == 1.0 and metrics["lr"] == pytest.approx(0.5e-2)
        assert all(torch.equal(weights(clean)[k], v) for k, v in weights(client).items())


@pytest.mark.parametrize("backend", ["torch", "deepspeed-zero2"])
def test_a_batch_whose_tokens_are_all_masked_is_a_zero_gradient_that_the_next_step_applies(backend, tiny_policy):
    """As every framework's loop does: the backward of a batch whose response tokens are all masked
    out is a zero gradient, and the next step applies it. The step counts, the schedule advances,
    AdamW's weight decay moves every weight by exactly ``lr * weight_decay`` (its zero moments move
    nothing), and the step after it runs at the schedule's next rate."""
    decay = 0.1
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0, "trainer": {
        **TRAINER, **BACKENDS[backend], "optimizer": {**TRAINER["optimizer"], "weight_decay": decay},
        "scheduler": {"name": "linear", "warmup_steps": 2, "total_steps": 9}}})
    with build_client(config) as client:
        batch = random_grpo_batch(server_of(client).sampler.model.config.vocab_size)
        masked = batch.replace(loss_mask=torch.zeros_like(batch.loss_mask))
        before = weights(client)
        client.fwd_bwd(masked, LOSS)
        metrics = client.step().metrics
        assert metrics["skipped"] == 0.0 and metrics["step"] == 1.0 and metrics["grad_norm"] == 0.0
        assert metrics["lr"] == pytest.approx(0.5e-2)
        for name, weight in weights(client).items():
            torch.testing.assert_close(weight, before[name] * (1 - 0.5e-2 * decay), rtol=1e-6, atol=0)
        client.fwd_bwd(batch, LOSS)
        metrics = client.step().metrics
        assert metrics["step"] == 2.0 and metrics["lr"] == pytest.approx(1e-2) and metrics["grad_norm"] > 0

def test_a_failed_fwd_bwd_discards_the_step_and_a_refused_one_changes_nothing(tiny_policy):
    """A call that fails part-way has added part of its gradient: it is discarded, with what the
    step had before it. A refused call touched nothing: what came before it stays."""
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
                                     "trainer": {**TRAINER, "backend": "deepspeed"}})
    with build_client(config) as client, build_client(config) as clean:
        batch = random_grpo_batch(server_of(client).sampler.model.config.vocab_size)
        client.fwd_bwd(batch, LOSS)
        with pytest.raises(RuntimeError, match="half-way"):
            client.fwd_bwd(batch, "fails_midway")
        client.fwd_bwd(batch, LOSS)
        with pytest.raises(BatchError, match="half-way"):
            client.fwd_bwd(batch, "refuses_midway")
        client.fwd_bwd(batch, LOSS)
        vocab = server_of(client).sampler.model.config.vocab_size
        for refused, message in ((batch.replace(old_logprobs=None), "old_logprobs"),
                                 (batch.replace(response_ids=batch.response_ids.clamp(max=0) + vocab), "vocab size")):
            with pytest.raises(BatchError if message == "old_logprobs" else RequestError, match=message):
                client.fwd_bwd(refused, "ppo")
        client.fwd_bwd(batch, LOSS, scale=0.5)
        client.step()
        clean.fwd_bwd(batch, LOSS)
        clean.fwd_bwd(batch, LOSS, scale=0.5)
        clean.step()
        assert all(torch.equal(weights(clean)[k], v) for k, v in weights(client).items())


@pytest.mark.parametrize("backend", ["torch", "deepspeed-zero2"])
def test_a_failed_step_drops_its_gradients_and_keeps_the_schedules_rate(backend, tiny_policy, monkeypatch):
    """An optimizer step that fails may have clipped the gradients in place or applied part of them:
    they are dropped (never applied a second time), and a rate the call passed does not outlive it."""
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
                                     "trainer": {**TRAINER, **BACKENDS[backend],
                                                 "scheduler": {"name": "linear", "warmup_steps": 2, "total_steps": 9}}})
    with build_client(config) as client, build_client(config) as clean:
        batch = random_grpo_batch(server_of(client).sampler.model.config.vocab_size)
        trainer = server_of(client).trainer
        engine = trainer.optimizer if backend == "torch" else trainer.engine

        def fails(*args, **kwargs):
            raise RuntimeError("the optimizer failed half-way")

        client.fwd_bwd(batch, LOSS)
        monkeypatch.setattr(engine, "step", fails)
        with pytest.raises(RuntimeError, match="half-way"):
            client.step(lr=0.5)
        monkeypatch.undo()
        assert client.step().metrics["skipped"] == 1.0  # nothing left to apply
        for each in (client, clean):
            each.fwd_bwd(batch, LOSS)
            metrics = each.step().metrics
            assert metrics["skipped"] == 0.0 and metrics["step"] == 1.0 and metrics["lr"] == pytest.approx(0.5e-2)
        assert all(torch.equal(weights(clean)[k], v) for k, v in weights(client).items())


def test_a_backend_or_transport_answering_outside_the_protocol_is_named_and_its_gradients_dropped(tiny_policy,
                                                                                                  monkeypatch):
    """A plugin's forward_backward, optimizer_step or sync that returns no dict of metrics is named
    with the rule (the server failed later on it, naming nothing), and a fwd_bwd's gradient it may
    have added is dropped: a client that repeats the call does not count the batch twice."""
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
                                     "trainer": {**TRAINER, "backend": "torch"}})
    with build_client(config) as client, build_client(config) as clean:
        server = server_of(client)
        batch = random_grpo_batch(server.sampler.model.config.vocab_size)
        trainer_class = type(server.trainer)
        forward_backward = trainer_class.forward_backward
        monkeypatch.setattr(trainer_class, "forward_backward", lambda *a, **k: forward_backward(*a, **k) and None)
        with pytest.raises(TypeError, match=r"TorchTrainer.forward_backward returned NoneType: it returns a dict"):
            client.fwd_bwd(batch, LOSS)
        monkeypatch.undo()
        assert client.step().metrics["skipped"] == 1.0  # the gradient it added was dropped
        for each in (client, clean):
            each.fwd_bwd(batch, LOSS)
            each.step()
        assert all(torch.equal(weights(clean)[k], v) for k, v in weights(client).items())
        monkeypatch.setattr(type(server.weight_transport), "sync", lambda *a, **k: None)
        with pytest.raises(TypeError, match=r"InProcessWeightSync.sync returned NoneType"):
            client.sync_weights()
        assert client.status().policy_version == 0  # its retry sends the same version


@pytest.mark.parametrize("lr", [float("inf"), float("nan"), -1.0, 2.0])
def test_a_learning_rate_that_is_not_a_rate_is_refused_before_anything_moves(lr, tiny_policy):
    config = ArcticConfig.from_dict({"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
                                     "trainer": {**TRAINER, "backend": "torch"}})
    with build_client(config) as client:
        client.fwd_bwd(random_grpo_batch(server_of(client).sampler.model.config.vocab_size), LOSS)
        before = weights(client)
        with pytest.raises(RequestError, match=r"lr: Input should be (a finite number|greater than or equal to 0|"
                                               r"less than or equal to 1)"):
            client.step(lr=lr)
        assert all(torch.equal(before[k], v) for k, v in weights(client).items())
        assert client.step().metrics["skipped"] == 0.0  # the gradients are still there

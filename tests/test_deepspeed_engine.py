"""The DeepSpeed backends against the reference ones, through the real client, for ZeRO stages 0, 2, 3.

Each stage runs one scripted session (module-scoped, since building engines dominates the cost);
the tests below check what it recorded.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient
from arctic_core.config import ArcticConfig
from arctic_core.errors import ConfigError, RequestError
from helpers import PROMPTS, trainer_of, weights

pytestmark = pytest.mark.slow

LOSS = [{"name": "ppo", "clip_low": 0.2, "clip_high": 0.28}, {"name": "entropy", "weight": 0.01}]
TRAINER = {
    "micro_batch_tokens": 16,  # several micro-batches per call
    "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    "scheduler": {"name": "linear", "warmup_steps": 2, "total_steps": 10},
}
STAGES = [0, 2, 3]


@pytest.fixture(scope="module")
def config_of(tiny_policy: Path):
    def make(trainer: dict[str, Any] | None = None, **overrides: Any) -> ArcticConfig:
        data = {"model": {"path": str(tiny_policy), "device": "cpu"}, "seed": 0,
                "trainer": {**TRAINER, **(trainer or {})}}
        return ArcticConfig.from_dict({**data, **overrides})

    return make


def deepspeed_trainer(stage: int) -> dict[str, Any]:
    return {"backend": "deepspeed", "options": {"zero_stage": stage}}


def halves(batch: RolloutBatch) -> list[tuple[RolloutBatch, float]]:
    """The batch in two calls, each weighed by its share of loss tokens (so they add up to the whole)."""
    total = int(batch.loss_mask.sum())
    parts = [batch.select(range(0, 5)), batch.select(range(5, batch.num_responses))]
    return [(part, int(part.loss_mask.sum()) / total) for part in parts]


def session(client: ArcticClient, batch: RolloutBatch, grads_of) -> dict[str, Any]:
    """Two accumulated calls and a step; what every backend must reproduce."""
    out: dict[str, Any] = {"logprobs": client.log_probs(batch, processors=["logprobs", "entropy"]).outputs}
    out["before"] = weights(client)
    for part, share in halves(batch):
        client.fwd_bwd(part, LOSS, scale=share)
    out["grads"] = grads_of(client)
    out["untouched"] = weights(client)
    out["step"] = client.step().metrics
    out["after"] = weights(client)
    return out


@pytest.fixture(scope="module")
def batch(config_of) -> RolloutBatch:
    with ArcticClient.in_process(config_of()) as client:
        rollout = client.generate(PROMPTS, n=3, max_tokens=6, seed=7).batch
        rewards = torch.linspace(-1, 1, rollout.num_responses)
        old = client.log_probs(rollout).outputs["logprobs"]
    return rollout.replace(old_logprobs=old, advantages=rewards, rewards=rewards)


def reference_grads(client: ArcticClient) -> dict[str, torch.Tensor]:
    return trainer_of(client).full_gradients()


REFERENCE = {"backend": "torch"}


@pytest.fixture(scope="module")
def reference(config_of, batch) -> dict[str, Any]:
    with ArcticClient.in_process(config_of(REFERENCE)) as client:
        client.fwd_bwd(batch, LOSS)
        full = reference_grads(client)
    with ArcticClient.in_process(config_of(REFERENCE)) as client:
        out = session(client, batch, reference_grads)
    return {**out, "full_grads": full}


@pytest.fixture(scope="module", params=STAGES, ids=[f"zero{s}" for s in STAGES])
def deepspeed_run(request, config_of, batch, tmp_path_factory) -> dict[str, Any]:
    stage = request.param
    ckpt = tmp_path_factory.mktemp(f"zero{stage}") / "ckpt"
    config = config_of(trainer=deepspeed_trainer(stage),
                       reference={"backend": "deepspeed", "options": {"zero_stage": stage}})
    with ArcticClient.in_process(config) as client:
        out = session(client, batch, lambda c: trainer_of(c).full_gradients())
        out["ref_logprobs"] = client.log_probs(batch, model="reference").outputs["logprobs"]
        client.save_checkpoint(str(ckpt), export_hf=True)
        exported = AutoModelForCausalLM.from_pretrained(ckpt / "hf").state_dict()
        out["exported"] = {k: v.float() for k, v in exported.items()}
        out["next_loss"] = client.fwd_bwd(batch, LOSS).metrics["loss"]
        out["next_step"] = client.step().metrics
        out["next_weights"] = weights(client)
    with ArcticClient.in_process(config) as resumed:
        status = resumed.load_checkpoint(str(ckpt))
        out["resumed_status"] = (status.step, status.policy_version)
        out["resumed_weights"] = weights(resumed)
        out["resumed_loss"] = resumed.fwd_bwd(batch, LOSS).metrics["loss"]
        out["resumed_step"] = resumed.step().metrics
        out["resumed_next_weights"] = weights(resumed)
    return out


def max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest per-tensor ``|a - b| / |b|`` (norms over each tensor)."""
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).norm() / (b[k].norm() + 1e-12)) for k in a)


def rounded_apart(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The share of bf16 weights that differ between ``a`` and ``b``; each may differ by one bf16
    step at most (asserted)."""
    assert a.keys() == b.keys() and a
    differing = total = 0
    for k in a:
        gap, size = (a[k] - b[k]).abs(), torch.maximum(a[k].abs(), b[k].abs())
        assert (gap <= torch.finfo(torch.bfloat16).eps * size).all(), f"{k}: more than one bf16 step apart"
        differing, total = differing + int((gap > 0).sum()), total + gap.numel()
    return differing / total


def test_log_probs_equal_the_reference_backend(deepspeed_run, reference):
    for name in ("logprobs", "entropy"):
        torch.testing.assert_close(deepspeed_run["logprobs"][name], reference["logprobs"][name], atol=1e-5, rtol=0)
    # The forward-only DeepSpeed engine serves the same initial policy.
    torch.testing.assert_close(deepspeed_run["ref_logprobs"], reference["logprobs"]["logprobs"], atol=1e-5, rtol=0)


def test_gradients_accumulate_across_calls_to_the_full_batch_gradient(deepspeed_run, reference):
    assert max_relative_error(deepspeed_run["grads"], reference["full_grads"]) < 1e-4
    assert max_relative_error(deepspeed_run["grads"], reference["grads"]) < 1e-5
    assert max_relative_error(deepspeed_run["untouched"], deepspeed_run["before"]) == 0  # nothing moves before step()


def test_one_step_matches_the_reference_step(deepspeed_run, reference):
    ds, ref = deepspeed_run["step"], reference["step"]
    assert ds["lr"] == pytest.approx(ref["lr"]) and ds["step"] == 1.0
    assert ds["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    # Both ran the same calls, so the step sees the same gradient up to float rounding (checked
    # above to 1e-5); Adam's first update is lr * g / (|g| + eps) per element, so elements whose
    # gradient is tiny can still move by up to lr in a different direction: bound the update's
    # error relative to the update itself rather than per element.
    ds_update = {k: deepspeed_run["after"][k] - deepspeed_run["before"][k] for k in deepspeed_run["after"]}
    ref_update = {k: reference["after"][k] - reference["before"][k] for k in reference["after"]}
    assert max_relative_error(ds_update, ref_update) < 1e-3
    assert max_relative_error(deepspeed_run["after"], reference["after"]) < 1e-5


def test_checkpoint_resume_reproduces_the_next_step(deepspeed_run):
    assert deepspeed_run["resumed_status"] == (1, 1)
    assert max_relative_error(deepspeed_run["resumed_weights"], deepspeed_run["after"]) == 0
    assert deepspeed_run["resumed_loss"] == pytest.approx(deepspeed_run["next_loss"], abs=1e-7)
    assert deepspeed_run["resumed_step"]["lr"] == pytest.approx(deepspeed_run["next_step"]["lr"])
    assert deepspeed_run["resumed_step"]["step"] == 2.0
    assert max_relative_error(deepspeed_run["resumed_next_weights"], deepspeed_run["next_weights"]) < 1e-6


def test_hf_export_holds_the_full_trained_weights(deepspeed_run):
    assert max_relative_error(deepspeed_run["exported"], deepspeed_run["after"]) == 0


def train_step(client: ArcticClient, batch: RolloutBatch) -> float:
    client.fwd_bwd(batch, LOSS)
    return client.step().metrics["step"]


def test_a_checkpoint_that_does_not_fit_is_refused_before_deepspeed_loads_any_of_it(config_of, batch, tmp_path):
    """DeepSpeed loads the weights before it finds that the optimizer state does not fit: what
    must match is compared first, so such a checkpoint changes nothing."""
    grouped = {**deepspeed_trainer(2), "optimizer": {**TRAINER["optimizer"], "decay": "transformers"}}
    with ArcticClient.in_process(config_of(trainer=grouped)) as client:  # norms undecayed: two groups
        train_step(client, batch)
        client.save_checkpoint(str(tmp_path / "ckpt"))
    refusals = [(deepspeed_trainer(2), r"parameter groups of \[\d+, \d+\] parameters, this trainer's \[\d+\]"),
                ({**grouped, "options": {"zero_stage": 3}}, "saved with zero_stage 1 or 2, this trainer has 3")]
    for trainer, problem in refusals:
        with ArcticClient.in_process(config_of(trainer=trainer)) as client:
            train_step(client, batch)
            before, status = weights(client), client.status()
            with pytest.raises(RequestError, match=problem):
                client.load_checkpoint(str(tmp_path / "ckpt"))
            assert max_relative_error(weights(client), before) == 0
            assert (client.status().step, client.status().policy_version) == (status.step, status.policy_version)
            assert train_step(client, batch) == 2.0  # trains on


def test_a_load_failing_part_way_leaves_the_trainer_refusing_calls_until_one_loads_whole(config_of, batch, tmp_path):
    with ArcticClient.in_process(config_of(trainer=deepspeed_trainer(2))) as client:
        train_step(client, batch)
        client.save_checkpoint(str(tmp_path / "ckpt"))
        saved = weights(client)
        shutil.copytree(tmp_path / "ckpt", tmp_path / "damaged")
        for states in (tmp_path / "damaged" / "trainer" / "arctic").glob("*optim_states.pt"):
            states.unlink()  # DeepSpeed finds this out only after it has loaded the weights
        train_step(client, batch)
        with pytest.raises(RequestError, match="failed part-way .*partly restored"):
            client.load_checkpoint(str(tmp_path / "damaged"))
        for call in (lambda: client.fwd_bwd(batch, LOSS), lambda: client.log_probs(batch), client.sync_weights,
                     lambda: client.save_checkpoint(str(tmp_path / "mixture"))):
            with pytest.raises(RequestError, match="partly restored"):
                call()
        assert not (tmp_path / "mixture").exists()
        assert client.load_checkpoint(str(tmp_path / "ckpt")).step == 1
        assert max_relative_error(weights(client), saved) == 0
        assert train_step(client, batch) == 2.0


def test_an_unknown_option_is_a_config_error_naming_it(config_of):
    with pytest.raises(ConfigError, match="zero_stag"):
        ArcticClient.in_process(config_of(trainer={"backend": "deepspeed", "options": {"zero_stag": 3}}))
    with pytest.raises(ConfigError, match="offload_optimizer needs zero_stage"):
        ArcticClient.in_process(config_of(trainer={"backend": "deepspeed",
                                                   "options": {"offload_optimizer": True, "zero_stage": 0}}))


def counting(forward, calls: list[int], index: int):
    def counted(*args, **kwargs):
        calls[index] += 1
        return forward(*args, **kwargs)

    return counted


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpointing_the_first_layers_recomputes_only_those_and_keeps_the_gradients(config_of, batch, reference,
                                                                                       stage):
    trainer = {**deepspeed_trainer(stage), "gradient_checkpointing": True, "checkpoint_layers": 1}
    with ArcticClient.in_process(config_of(trainer=trainer)) as client:
        layers = trainer_of(client).model.model.layers
        calls = [0] * len(layers)
        for index, layer in enumerate(layers):  # counted in forward itself: a recompute skips module hooks
            layer.mlp.forward = counting(layer.mlp.forward, calls, index)
        client.fwd_bwd(batch, LOSS)
        grads = trainer_of(client).full_gradients()
    # Each micro-batch runs every layer once forward; the checkpointed first layer once more in backward.
    assert len(layers) == 2 and calls[1] > 0 and calls == [2 * calls[1], calls[1]]
    assert max_relative_error(grads, reference["full_grads"]) < 1e-4


@pytest.mark.parametrize(("backend", "free", "recomputed"), [
    ("deepspeed3", "one layer's worth", [1, 0]), ("torch", "one layer's worth", [1, 0]),
    ("deepspeed3", "plenty", [0, 0]), ("deepspeed3", "none (CPU)", [1, 1]),
])
def test_auto_checkpointing_keeps_the_layers_free_memory_holds(config_of, batch, reference, monkeypatch, backend, free,
                                                              recomputed):
    # One micro-batch per call. "One layer's worth" is the budget in which exactly the last of the two
    # layers keeps its activations; "plenty" holds both; off CUDA there is no budget: all are recomputed.
    from arctic_zorro import checkpoint_policy, packed_forward
    from arctic_zorro.packed_forward import HEAD_CHUNK_TOKENS

    options = deepspeed_trainer(3) if backend == "deepspeed3" else REFERENCE
    trainer = {**options, "micro_batch_tokens": 4096, "gradient_checkpointing": True, "checkpoint_layers": "auto"}
    with ArcticClient.in_process(config_of(trainer=trainer)) as client:
        engine = trainer_of(client)
        model = engine.model
        tokens = checkpoint_policy.micro_batch_tokens(batch, grouped=True)
        kept = checkpoint_policy.kept_layer_bytes(model.config, 4)
        head = (min(int(batch.response_lens.sum()), HEAD_CHUNK_TOKENS) * model.config.vocab_size
                * checkpoint_policy.HEAD_BYTES_PER_LOGIT)
        budget = {"one layer's worth": tokens * (2 * kept + model.config.hidden_size * 4) + head,
                  "plenty": 1 << 40, "none (CPU)": None}[free]
        monkeypatch.setattr(checkpoint_policy, "activation_budget", lambda device: budget)
        # The LM head keeps its logits for the backward where the same budget holds them ("plenty").
        monkeypatch.setattr(packed_forward, "activation_budget", lambda device: budget)
        layers = model.model.layers
        calls = [0] * len(layers)
        for index, layer in enumerate(layers):
            layer.mlp.forward = counting(layer.mlp.forward, calls, index)
        head_rows = []
        model.get_output_embeddings().register_forward_hook(lambda module, args, out: head_rows.append(out.shape[0]))
        client.fwd_bwd(batch, LOSS)
        grads = engine.full_gradients()
    assert calls == [1 + recomputed[0], 1 + recomputed[1]]
    if free != "one layer's worth":  # the head's chunks: run once where kept, again in the backward where not
        assert sum(head_rows) == int(batch.response_lens.sum()) * (1 if free == "plenty" else 2)
    assert max_relative_error(grads, reference["full_grads"]) < 1e-4


@pytest.mark.parametrize("backend", ["deepspeed3", "torch"])
def test_compiled_elementwise_layers_give_the_reference_log_probs_and_gradients(config_of, batch, reference, backend):
    import functools

    from arctic_zorro import fused_elementwise

    options = deepspeed_trainer(3) if backend == "deepspeed3" else REFERENCE
    trainer = {**options, "compile_elementwise": True, "gradient_checkpointing": True}  # recomputed layers too
    with ArcticClient.in_process(config_of(trainer=trainer)) as client:
        model = trainer_of(client).model
        fused = [m for m in model.modules() if isinstance(m.forward, functools.partial)
                 and m.forward.func in (fused_elementwise._norm_forward, fused_elementwise._mlp_forward)]
        norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
        assert len(fused) == len(norms) + len(model.model.layers) and len(norms) == 4 * len(model.model.layers) + 1
        rotary = [layer.self_attn for layer in model.model.layers
                  if layer.self_attn.forward.__func__ is fused_elementwise._attention_forward(type(layer.self_attn))]
        assert len(rotary) == len(model.model.layers)
        logprobs = client.log_probs(batch, processors=["logprobs", "entropy"]).outputs
        client.fwd_bwd(batch, LOSS)
        grads = trainer_of(client).full_gradients()
    for name in ("logprobs", "entropy"):
        torch.testing.assert_close(logprobs[name], reference["logprobs"][name], atol=1e-5, rtol=0)
    assert max_relative_error(grads, reference["full_grads"]) < 1e-4


def test_compile_elementwise_refuses_models_it_does_not_cover_and_auto_skips_them(tiny_policy):
    from transformers import AutoConfig

    from arctic_zorro.fused_elementwise import apply_compile_elementwise

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ConfigError,
                       match="compile_elementwise supports qwen3, qwen2, llama, mistral models, not 'gpt2'"):
        apply_compile_elementwise(gpt2, True)
    assert apply_compile_elementwise(gpt2, "auto") == []  # the default: other families run as they are
    qwen3 = AutoModelForCausalLM.from_pretrained(tiny_policy)
    assert apply_compile_elementwise(qwen3, "auto") == []  # compiling pays on a GPU, not on the CPU
    assert apply_compile_elementwise(qwen3, False) == []
    assert len(apply_compile_elementwise(qwen3, True)) == 6 * qwen3.config.num_hidden_layers + 1


def test_checkpoint_layers_are_checked_against_the_model(config_of):
    with pytest.raises(ConfigError, match="checkpoint_layers needs gradient_checkpointing"):
        config_of(trainer={"checkpoint_layers": 1})
    too_many = {**deepspeed_trainer(0), "gradient_checkpointing": True, "checkpoint_layers": 3}
    with pytest.raises(ConfigError, match=r"checkpoint_layers \(3\) exceeds the model's 2 decoder layers"):
        ArcticClient.in_process(config_of(trainer=too_many))


def test_adamw_runs_fused_only_where_its_states_live_on_a_gpu():
    from arctic_core.config import ModelConfig, TrainerConfig
    from arctic_zorro.deepspeed_engine import DeepSpeedTrainerOptions, trainer_config

    model, trainer = ModelConfig(path="unused", dtype="bfloat16"), TrainerConfig()

    def params(options, on_gpu):
        return trainer_config(options, trainer, model, on_gpu=on_gpu)["optimizer"]["params"]

    assert params(DeepSpeedTrainerOptions(), on_gpu=True)["fused"] is True
    assert "fused" not in params(DeepSpeedTrainerOptions(), on_gpu=False)
    assert "fused" not in params(DeepSpeedTrainerOptions(offload_optimizer=True), on_gpu=True)  # steps on the CPU


def bf16_session(config_of, batch: RolloutBatch, tiny_policy: Path, stage: int, ckpt: Path) -> dict[str, Any]:
    """The scripted session in bf16 at ``stage``, a checkpoint after its step, the next step, and
    the same next step from the checkpoint in a new server."""
    model = {"path": str(tiny_policy), "device": "cpu", "dtype": "bfloat16"}
    config = config_of(trainer=deepspeed_trainer(stage), model=model)

    def next_step(client: ArcticClient) -> tuple[float, dict[str, float], dict[str, torch.Tensor]]:
        loss = client.fwd_bwd(batch, LOSS).metrics["loss"]
        return loss, client.step().metrics, weights(client)

    with ArcticClient.in_process(config) as client:
        out = session(client, batch, lambda c: trainer_of(c).full_gradients())
        client.save_checkpoint(str(ckpt))
        client.fwd_bwd(batch, LOSS)
        trainer_of(client).discard_gradients()  # as after a failed call: the next step must not see it
        out["next"] = next_step(client)
    with ArcticClient.in_process(config) as resumed:
        resumed.load_checkpoint(str(ckpt))
        out["resumed_next"] = next_step(resumed)
    return out


def test_bf16_zero_1_trains_as_zero_2(config_of, batch, tiny_policy, tmp_path):
    """bf16 at ZeRO-1 runs DeepSpeed's BF16_Optimizer (the faster step on one GPU), at ZeRO-2 the
    ZeRO optimizer: both accumulate in fp32 and step fp32 masters, so they give the same
    gradients (read back whole after several backward passes), steps, weights, discarded
    gradients and checkpoint resumption."""
    one, two = (bf16_session(config_of, batch, tiny_policy, stage, tmp_path / f"zero{stage}") for stage in (1, 2))
    for name in ("logprobs", "entropy"):
        assert torch.equal(one["logprobs"][name], two["logprobs"][name])
    assert max_relative_error(one["grads"], two["grads"]) < 1e-6
    # Each optimizer sums the squares in its own order and precision (the reported norm differs in
    # the 5th digit) and keeps its fp32 masters in its own buffers: a weight may round to the next
    # bf16 value (how many do depends on the CPU's bf16 kernels: a few on a CPU with AVX-512 BF16).
    assert one["step"]["grad_norm"] == pytest.approx(two["step"]["grad_norm"], rel=1e-4)
    assert rounded_apart(one["after"], two["after"]) <= 1e-4 and max_relative_error(one["after"], one["before"]) > 1e-4
    for ran in ("next", "resumed_next"):
        assert one[ran][0] == pytest.approx(two[ran][0], abs=1e-7)
        # Weights one bf16 value apart give slightly different gradients, which Adam's per-element
        # normalisation (lr * m / sqrt(v)) amplifies where a gradient is tiny.
        assert max_relative_error(one[ran][2], two[ran][2]) < 1e-3
    # The uninterrupted run discarded a gradient before its next step; the resumed run never had it.
    assert max_relative_error(one["resumed_next"][2], one["next"][2]) == 0


def test_bf16_zero_1_sums_gradients_as_deepspeed_does_in_one_pass(config_of, batch, tiny_policy, monkeypatch):
    """The bf16 optimizer's fp32 gradient sums, accumulated in one mixed-precision add per
    parameter and backward, equal DeepSpeed's own pass (zero, add, copy to fp32, add) bit for bit,
    and no bf16 gradient outlives the backward that made it."""
    from arctic_zorro import deepspeed_engine

    model = {"path": str(tiny_policy), "device": "cpu", "dtype": "bfloat16"}

    def sums() -> tuple[dict[str, torch.Tensor], list[str]]:
        with ArcticClient.in_process(config_of(trainer=deepspeed_trainer(1), model=model)) as client:
            for part, share in halves(batch):
                client.fwd_bwd(part, LOSS, scale=share)
            trainer = trainer_of(client)
            kept = [name for name, param in trainer.model.named_parameters() if param.grad is not None]
            return trainer.full_gradients(), kept

    ours, kept = sums()
    monkeypatch.setattr(deepspeed_engine, "accumulate_bf16_grads_in_one_pass", lambda optimizer: None)
    own, own_kept = sums()
    assert kept == [] and own_kept  # DeepSpeed's own pass keeps every last bf16 gradient
    assert ours.keys() == own.keys() and all(torch.equal(ours[name], own[name]) for name in ours)
    assert max(float(grad.abs().max()) for grad in ours.values()) > 0


def test_bf16_zero_1_refuses_to_sleep_and_keeps_training(config_of, batch, tiny_policy):
    """bf16 at ZeRO-1 accumulates in fp32 through DeepSpeed's BF16_Optimizer, which cannot move its
    states: sleep is refused with an error naming the way out, and the trainer keeps training."""
    model = {"path": str(tiny_policy), "device": "cpu", "dtype": "bfloat16"}
    with ArcticClient.in_process(config_of(trainer=deepspeed_trainer(1), model=model)) as client:
        with pytest.raises(RequestError,
                           match="cannot sleep at zero_stage 1 with model.dtype bfloat16.*zero_stage 2 or 3"):
            client.sleep(["trainer"])
        assert client.transport.server.asleep == set()
        client.fwd_bwd(batch, LOSS)
        assert client.step().metrics["grad_norm"] > 0


def test_a_build_lock_left_by_a_killed_build_is_named(tmp_path, monkeypatch, caplog):
    """torch waits forever, silently, on the lock a killed op build leaves: the engine names it."""
    import os
    import time

    from arctic_zorro import deepspeed_engine

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "fused_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    with caplog.at_level("WARNING", logger=deepspeed_engine.__name__):
        deepspeed_engine.warn_of_stale_build_locks()
    named = [r.getMessage() for r in caplog.records if r.name == deepspeed_engine.__name__]
    assert len(named) == 1 and named[0].startswith(f"{stale} is 3600 s old: this process waits")
    caplog.clear()
    with caplog.at_level("WARNING", logger=deepspeed_engine.__name__):  # once a start has waited on them
        deepspeed_engine.warn_of_stale_build_locks(older_than=0.0)
    named = sorted(r.getMessage() for r in caplog.records if r.name == deepspeed_engine.__name__)
    assert [m.split(" is ")[0] for m in named] == [str(stale), str(fresh)]


def test_a_world_of_one_on_the_cpu_starts_without_building_deepspeeds_comm_op(tmp_path):
    """DeepSpeed's CPU comm layer would JIT-compile its shared-memory op (tens of seconds, the first
    time): a fresh extensions folder stays empty, and the comm layer runs on torch.distributed."""
    import os
    import subprocess
    import sys

    script = """
import importlib, torch
from arctic_zorro import deepspeed_engine
import deepspeed
deepspeed_engine.init_distributed()
assert importlib.import_module("deepspeed.comm.comm").cdb.shm_comm_op is None
counts = torch.ones(2)
deepspeed.comm.all_reduce(counts)
print("reduced", counts.tolist())
"""
    extensions = tmp_path / "torch_extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "reduced [1.0, 1.0]"
    assert not extensions.exists() or not any(extensions.iterdir())


def test_a_world_of_one_starts_while_another_process_holds_its_master_port():
    """Engines start side by side (a test run, a node's workers): a world of one binds no port, so
    the port its variables name may be taken between import and start."""
    import subprocess
    import sys

    script = """
import os, socket, torch
from arctic_zorro import deepspeed_engine
taken = socket.socket()
taken.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
taken.listen()
deepspeed_engine.init_distributed()
assert torch.distributed.get_world_size() == 1 and torch.distributed.get_rank() == 0
print("started on", torch.distributed.get_backend())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "started on gloo"

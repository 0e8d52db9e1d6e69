"""PRIME-RL's rollout files and loss, from fixtures its own code recorded (``fixtures/record_fixtures.py``
ran ``prepare_batch``, its msgspec encoder and ``compute_loss`` at the commit named in
``arctic_primerl.wire``): Arctic reads the same samples back and its loss terms give the same loss
and gradients on the same tokens."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from arctic_core.config import LossTermConfig
from arctic_core.errors import ConfigError
from arctic_core.losses.objective import build_objective
from arctic_core.plugins.interfaces import LossContext
from arctic_core.plugins.registry import default_registry
from arctic_primerl import samples as sample_ops
from arctic_primerl.loss import loss_terms
from arctic_primerl.trainer import RunFolder, add_call_metrics
from arctic_primerl.wire import PRIME_RL_COMMIT, MicroBatch, WireError, decode, encode
from runs import FIXTURES

ROLLOUTS = (FIXTURES / "rollouts_rank_0.bin").read_bytes()
PARITY = json.loads((FIXTURES / "loss_parity.json").read_text())


def test_the_fixtures_come_from_the_pinned_prime_rl():
    assert PARITY["prime_rl_commit"] == PRIME_RL_COMMIT


def test_samples_come_back_as_prompt_groups():
    sent = json.loads((FIXTURES / "samples.json").read_text())
    trained = [s for s in sent if not (s.get("rl_weights") and not any(s["rl_weights"]))]  # zero advantage: weight 0
    got = sample_ops.unpack(decode(ROLLOUTS))
    assert len(got) == len(trained) == 5
    for want in trained:
        mask = want["mask"]
        first, last = mask.index(True), len(mask) - 1 - mask[::-1].index(True)
        match = [s for s in got if s.prompt + s.response == want["token_ids"][: last + 1]]
        assert len(match) == 1, want["token_ids"]
        (s,) = match
        assert s.prompt == want["token_ids"][:first] and s.trainable == mask[first : last + 1]
        assert s.inference_logprobs == pytest.approx(want["logprobs"][first : last + 1])
        assert s.temperature == want["temperatures"][0] and s.env_name == want["env_name"]
    batches = sample_ops.by_temperature(got)
    assert sorted(batches) == [0.7, 1.0]
    assert batches[1.0].num_prompts == 1 and batches[1.0].num_responses == 3  # one prompt, packed once
    assert batches[0.7].num_prompts == 1 and batches[0.7].num_responses == 2


def test_a_step_of_prime_rls_real_orchestrator_trains_as_prompt_groups():
    """``fixtures/orchestrator_step_1_rank_0.bin``: what PRIME-RL's orchestrator wrote for step 1 of
    the CPU run in the PRIME-RL guide (reverse-text, batch 8, group 4)."""
    batches = decode((FIXTURES / "orchestrator_step_1_rank_0.bin").read_bytes())
    (batch,) = sample_ops.by_temperature(sample_ops.unpack(batches)).values()
    assert batch.num_prompts == 2 and sorted(len(rows) for rows in batch.groups()) == [4, 4]
    assert batch.packed_tokens() < batch.total_tokens() / 4  # the shared system + user prompt packed once
    assert bool(batch.loss_mask.any(dim=1).all())


@pytest.mark.parametrize("case", PARITY["cases"], ids=lambda c: f"{c['config']['type']}-kl{c['config']['kl_tau']}")
def test_loss_and_gradients_equal_prime_rls(case):
    """The trainer log-probs of every packed token, placed where each sample's response lies in
    Arctic's batches: Arctic's terms over the step give PRIME-RL's loss and its gradient."""
    got = sample_ops.unpack(decode(ROLLOUTS))
    count = sample_ops.count_trainable(got)
    assert count == case["rl_scale"]
    flat = [torch.tensor(row, dtype=torch.float64, requires_grad=True) for row in case["trainer_logprobs"]]
    objective = build_objective(default_registry(), [LossTermConfig(**t) for t in loss_terms(case["config"])])
    total = torch.zeros((), dtype=torch.float64)
    for temperature, batch in sample_ops.by_temperature(got).items():
        rows = [s for s in got if s.temperature == temperature]
        logp = torch.stack([_row(flat, s, batch.response_ids.shape[1]) for s in rows])
        loss, _ = objective({"logprobs": logp, "entropy": torch.zeros_like(logp)}, batch, LossContext.of(batch))
        total = total + loss / count
    assert total.item() == pytest.approx(case["loss"], abs=1e-6)
    total.backward()
    for mine, theirs in zip(flat, case["grads"], strict=True):
        assert torch.allclose(mine.grad, torch.tensor(theirs, dtype=torch.float64), atol=1e-6, rtol=1e-4)


def _row(flat: list[torch.Tensor], sample: sample_ops.Sample, width: int) -> torch.Tensor:
    micro_batch, start = sample.origin
    values = flat[micro_batch][start : start + len(sample.response)]
    return torch.cat([values, values.new_zeros(width - len(values))])


def test_prime_rl_loss_settings_map_or_are_refused_by_name():
    assert loss_terms(None) == loss_terms({"type": "default"})
    ipo = loss_terms({"type": "ipo", "ipo_threshold": 0.3, "kl_tau": 0.0})
    assert ipo == [{"name": "dppo", "weight": 1.0, "aggregation": "token-sum", "mask_low": 0.3, "mask_high": 0.3,
                    "trust_region": "both-sides"}, {"name": "entropy", "weight": 0.0, "aggregation": "token-sum"}]
    with pytest.raises(ConfigError, match="'custom' is not supported"):
        loss_terms({"type": "custom", "import_path": "my.loss"})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['clip'\]"):
        loss_terms({"clip": 0.2})


def _one(**changes) -> MicroBatch:
    batch = MicroBatch(input_ids=[1, 2, 3, 4], loss_mask=[False, False, True, True], advantages=[0, 0, 1, 1],
                       inference_logprobs=[0, 0, -1, -1], position_ids=[0, 1, 2, 3], sequence_lengths=[4],
                       temperatures=[1.0] * 4, env_names=["e"] * 4, seq_lens=[4])
    for name, value in changes.items():
        setattr(batch, name, value)
    return batch


def test_files_of_another_prime_rl_version_or_malformed_are_refused_by_name():
    legacy = msgspec.msgpack.encode([msgspec.to_builtins(_one())[:9]])  # an older, 9-field micro-batch
    with pytest.raises(WireError, match="have \\[9\\] fields.*writes 16"):
        decode(legacy)
    with pytest.raises(WireError, match="not msgpack|micro-batch arrays"):
        decode(b"\x00garbage")
    with pytest.raises(WireError, match="loss_mask has 3 entries for 4 input_ids"):
        decode(encode([_one(loss_mask=[False, True, True])]))
    with pytest.raises(WireError, match="do not tile"):
        decode(encode([_one(sequence_lengths=[3])]))
    cases = {"cross-entropy": _one(ce_weights=[0, 0, 1, 1]), "first token is trainable": _one(loss_mask=[True] * 4),
             "other than 0 and 1": _one(rl_weights=[1, 1, 0.5, 1]),
             "several temperatures": _one(temperatures=[1, 1, 0.5, 1])}
    for message, batch in cases.items():
        with pytest.raises(WireError, match=message):
            sample_ops.unpack(decode(encode([batch])))


def test_a_steps_metrics_merge_its_calls_by_tokens():
    # Two fwd_bwd calls (two sampling temperatures) of one step with 40 trainable tokens, 30 and 10:
    # losses are token sums over the step's tokens, counts add up, token means weigh by share.
    totals = {"loss": 0.0}
    add_call_metrics(totals, {"loss": 6.0, "dppo/loss": 6.0, "tokens": 30, "packed_tokens": 10, "kl": 0.5}, 0.75, 40)
    add_call_metrics(totals, {"loss": 2.0, "dppo/loss": 2.0, "tokens": 10, "packed_tokens": 5, "kl": 0.1}, 0.25, 40)
    assert totals == pytest.approx({"loss": 0.2, "dppo/loss": 0.2, "tokens": 40, "packed_tokens": 15, "kl": 0.4})


def test_keep_last_prunes_arctics_step_checkpoints_and_leaves_prime_rls_files(tmp_path):
    run = RunFolder(tmp_path)
    for step in (1, 2, 3, 10):
        run.checkpoint(step).mkdir(parents=True)
    (run.checkpoint(2).parent / "orchestrator").mkdir()  # PRIME-RL's own part of step 2's checkpoint
    run.prune_checkpoints(2)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("checkpoints/*/*"))
    assert left == ["checkpoints/step_10/arctic", "checkpoints/step_2/orchestrator", "checkpoints/step_3/arctic"]
    assert not (tmp_path / "checkpoints" / "step_1").exists()  # emptied, so removed


def test_a_run_folder_of_an_earlier_run_is_refused_unless_resumed_or_cleaned(tmp_path):
    run = RunFolder(tmp_path)
    for kind in ("rollouts", "broadcasts"):
        for step in (1, 2, 3):
            (tmp_path / kind / f"step_{step}").mkdir(parents=True)
    run.checkpoint(2).mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds the steps of an earlier run; set clean = true"):
        run.prepare(resume_step=None, clean=False)  # the trainer would train on step 1's old rollouts
    run.prepare(resume_step=2, clean=False)  # resuming: the steps after 2 would be read as new
    assert sorted(run.steps("rollouts")) == sorted(run.steps("broadcasts")) == [1, 2]
    run.prepare(resume_step=None, clean=True)
    assert not any(run.steps(kind) for kind in ("rollouts", "broadcasts", "checkpoints"))


def test_keep_interval_keeps_every_nth_checkpoint(tmp_path):
    run = RunFolder(tmp_path)
    for step in (5, 10, 15, 20, 25):
        run.checkpoint(step).mkdir(parents=True)
    run.prune_checkpoints(2, keep_interval=10)
    assert sorted(run.steps("checkpoints")) == [10, 20, 25]

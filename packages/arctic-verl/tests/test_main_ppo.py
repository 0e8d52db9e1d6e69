"""verl's unmodified ``python -m verl.trainer.main_ppo`` with ``trainer.v1.trainer_mode=arctic``.

A tiny random policy, a GSM8K-format dataset scored by verl's own ``gsm8k`` reward function,
GRPO with verl's KL loss: three steps on the Arctic backend (started by the adapter as a Ray actor
in verl's Ray cluster), validation, a checkpoint, and a second run that resumes from it. verl's
default of 8 agent-loop workers, each sending its prompt's samples: the server's sampler decodes
the calls of all of them in shared steps.
"""

from __future__ import annotations

import json

import pytest

from adapter_suites import check_calls_share_steps, check_run_ends_on_lost_server, serving
from verl_run import gsm8k_rows, logged_steps, main_ppo_args, run_main_ppo, write_parquet

VERL_METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr", "actor/entropy",
                "critic/score/mean", "critic/advantages/mean", "response_length/mean", "timing_s/step")
ARCTIC_METRICS = ("arctic/train/loss", "arctic/train/tokens", "arctic/step/grad_norm", "arctic/policy_version",
                  "arctic/sync/seconds")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # two whole verl runs
def test_three_grpo_steps_checkpoint_and_resume(policy, tmp_path):
    train = write_parquet(gsm8k_rows(8), tmp_path / "train.parquet")
    val = write_parquet(gsm8k_rows(4), tmp_path / "val.parquet")
    extra = ("actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.optim.lr=1e-4",
             "trainer.save_freq=3", "trainer.test_freq=3", "data.max_prompt_length=128",
             "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
             # weights from the sampler's log-probs; verl's rejection applied to the mask Arctic trains on
             "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token_k1",
             "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'")

    first = run_main_ppo(main_ppo_args(policy, train, val, tmp_path, steps=3, extra=extra), cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
    steps = logged_steps(first.stdout + first.stderr)
    assert sorted(steps) == [1, 2, 3]
    validation = [key for key in steps[3] if key.startswith("val-core/openai/gsm8k/")]
    assert validation, steps[3].keys()  # verl's validation ran, sampled by Arctic
    for step, metrics in steps.items():
        missing = [key for key in VERL_METRICS + ARCTIC_METRICS if key not in metrics]
        assert not missing, (step, missing)
        assert metrics["arctic/step/step"] == step  # one optimizer step per training step (one mini-batch)
        assert metrics["arctic/train/tokens"] > 0 and metrics["arctic/step/grad_norm"] >= 0
        # verl's own rollout-correction metrics beside the weights the loss applied
        assert metrics["arctic/train/ppo/sampler_weight"] > 0 and "rollout_corr/rollout_rs_masked_fraction" in metrics
    # sync_weights once per step: each step's samples come from the weights of the step before.
    versions = [steps[step]["arctic/policy_version"] for step in (1, 2, 3)]
    assert versions == [versions[0], versions[0] + 1, versions[0] + 2]
    checkpoint = tmp_path / "checkpoints" / "global_step_3"
    assert json.loads((checkpoint / "actor" / "arctic_state.json").read_text())["step"] == 3
    assert (checkpoint / "actor" / "huggingface" / "config.json").is_file()  # where verl puts hf_model
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    # verl's TensorBoard logger (in verl's task runner, a Ray actor), under runs/ as Hydra's run folder
    assert list((tmp_path / "runs" / "verl" / "tensorboard" / "arctic" / "test").glob("events.out.tfevents.*"))
    assert not (tmp_path / "tensorboard_log").exists() and not (tmp_path / "outputs").exists()

    second = run_main_ppo(main_ppo_args(policy, train, val, tmp_path, steps=4, extra=extra), cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-6000:]
    output = second.stdout + second.stderr
    assert f"Resuming from {checkpoint}" in output
    resumed = logged_steps(output)
    assert sorted(resumed) == [4]  # steps 1-3 are not redone
    assert resumed[4]["arctic/step/step"] == 4  # the optimizer state came back with the weights
    assert (tmp_path / "checkpoints" / "global_step_4" / "actor" / "arctic_state.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eight_agent_loop_workers_calls_share_the_samplers_steps(policy, tmp_path):
    """verl's default of 8 agent-loop workers (processes of their own), a batch of 8 prompts: each
    worker runs one prompt's 4 samples, which the adapter's rollout client sends as one generate call,
    and the calls of all workers join one running batch of the server's sampler. Counted by the
    server the run uses (``+arctic.url``): a call per prompt and step, and fewer than half the decode
    steps the calls would need one at a time.

    On 2 cores the first step's calls come up to seconds apart (each worker process starts its
    client and agent loop then) and share few steps; from the second step on the 8 calls arrive
    within a few decode steps of each other and share nearly all of theirs (about 160 decode steps
    for 8 x 127 one at a time, when measured). Over eight steps the total stays under half even when
    the first step's calls run one after another and each later step needs 300."""
    steps = 8
    data = write_parquet(gsm8k_rows(8), tmp_path / "data.parquet")  # a batch of 8: a prompt per worker
    with serving(policy) as url:
        # Responses long enough that the workers' calls, sent within a few steps of each other, overlap.
        args = main_ppo_args(policy, data, data, tmp_path, steps=steps, batch=8, workers=8, response_length=128,
                             extra=(f"+arctic.url={url}",))
        result = run_main_ppo(args, cwd=tmp_path)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        assert sorted(logged_steps(result.stdout + result.stderr)) == list(range(1, steps + 1))
        check_calls_share_steps(url, calls=steps * 8, samples_per_call=4)  # a call per prompt, rollout.n samples


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_server_gone_mid_run_is_named_on_the_last_line(policy, tmp_path):
    """A server on ``+arctic.url`` that goes away mid-run: the run ends on Arctic's line naming it.

    verl's own failure comes after the server's (an agent-loop worker's failed ``generate`` leaves its
    replay buffer with nothing to train on, and verl says so): without the adapter the run's last line
    would send the user to verl's sampler settings. The server here is ``tests/fault_server.py``, an
    ``arctic-rl serve`` that kills itself (SIGKILL) when the second step's sampling reaches it."""
    data = write_parquet(gsm8k_rows(4), tmp_path / "data.parquet")

    def run(url: str):
        args = main_ppo_args(policy, data, data, tmp_path, steps=3, extra=(f"+arctic.url={url}",))
        return run_main_ppo(args, cwd=tmp_path, merged=True)

    result = check_run_ends_on_lost_server(policy, "arctic-verl", run)
    assert sorted(logged_steps(result.stdout)) == [1], result.stdout[-6000:]  # step 1 trained; step 2's sampling failed

"""SkyRL's unmodified ``main_base`` with the Arctic override: GRPO steps on the real backend.

gsm8k-format prompts the test writes, scored by skyrl-gym's own ``gsm8k`` environment, a tiny
random model, 3 steps: SkyRL's metrics and Arctic's reach SkyRL's TensorBoard logger, the weights
reach the samplers after every step, SkyRL evaluates, exports a Hugging Face folder and saves a
checkpoint, and a second run resumes from it.
"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from adapter_suites import check_run_ends_on_lost_server
from skyrl_run import gsm8k_rows, logged_scalars, main_base_args, run_main_base, write_parquet

STEPS = 3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_main_base_trains_checkpoints_and_resumes_on_arctic(policy, tmp_path):
    data = write_parquet(gsm8k_rows(8), tmp_path / "train.parquet")
    val = write_parquet(gsm8k_rows(2), tmp_path / "val.parquet")
    extra = ("trainer.ckpt_interval=2", "trainer.policy_mini_batch_size=1",  # two optimizer steps per batch
             f"data.val_data=['{val}']", "trainer.eval_interval=3", "trainer.hf_save_interval=3")
    result = run_main_base(main_base_args(policy, data, tmp_path, steps=STEPS, extra=extra), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    scalars = logged_scalars(tmp_path / "tensorboard")
    for tag in ("reward/avg_raw_reward", "policy/final_loss", "policy/grad_norm", "policy/arctic/loss",
                "policy/arctic/tokens", "timing/sync_weights", "timing/generate"):
        assert sorted(scalars[tag]) == list(range(1, STEPS + 1)), tag
    # Two mini-batches per step, each an optimizer step at SkyRL's learning rate.
    assert all(value == pytest.approx(1e-6) for value in scalars["policy/policy_lr"].values())
    # One prompt group per mini-batch: its prompt is packed once under the n responses.
    assert all(value < scalars["policy/arctic/tokens"][step]
               for step, value in scalars["policy/arctic/packed_tokens"].items())
    assert any(tag.startswith("eval/") for tag in scalars)  # greedy evaluation through Arctic's samplers
    export = tmp_path / "exports" / f"global_step_{STEPS}" / "policy"
    assert AutoModelForCausalLM.from_pretrained(export).config.num_hidden_layers > 0
    assert AutoTokenizer.from_pretrained(export).chat_template
    for step in (2, 3):  # ckpt_interval, then the final save
        assert (tmp_path / "ckpts" / f"global_step_{step}" / "policy").is_dir()
    assert (tmp_path / "ckpts" / "latest_ckpt_global_step.txt").read_text() == "3"

    resumed = run_main_base(main_base_args(policy, data, tmp_path, steps=STEPS + 1, extra=extra), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert "Resuming from global_step: 3" in resumed.stdout + resumed.stderr
    scalars = logged_scalars(tmp_path / "tensorboard")
    assert STEPS + 1 in scalars["policy/final_loss"]  # the resumed run trained step 4 only
    assert (tmp_path / "ckpts" / "latest_ckpt_global_step.txt").read_text() == str(STEPS + 1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_server_gone_mid_run_is_named_on_the_last_line(policy, tmp_path):
    """A server on ``arctic.url`` that goes away mid-run: the run ends on Arctic's line naming it, not
    on what SkyRL's generator or trainer failed with next. The server is ``tests/fault_server.py``, an
    ``arctic-rl serve`` that kills itself (SIGKILL) when the second step's sampling reaches it."""
    data = write_parquet(gsm8k_rows(4), tmp_path / "train.parquet")

    def run(url: str):
        args = main_base_args(policy, data, tmp_path, steps=3,
                              extra=(f"arctic.url={url}", "trainer.algorithm.use_kl_loss=false"))  # no reference served
        return run_main_base(args, cwd=tmp_path, merged=True)

    check_run_ends_on_lost_server(policy, "arctic-skyrl", run)
    assert sorted(logged_scalars(tmp_path / "tensorboard")["policy/final_loss"]) == [1]

"""A two-turn skyrl-gym environment trains through Arctic, and the batch Arctic receives packs the
shared turn once.

With ``generator.step_wise_trajectories`` SkyRL trains each turn as its own row: the second turn's
row has the first turn (prompt, answer, the environment's reply, as SkyRL re-renders the chat) as
its prompt. Storing identical prompts once cannot share that history; Arctic's prefix forest stores
every shared prefix once, so the tokens it computes on (``packed_tokens``) are exactly the
distinct prefixes of the rows SkyRL trained on (read back from SkyRL's own batch dump), well below
what identical-prompt packing leaves (``prompt_packed_tokens``).

SkyRL's generator asks for each trajectory's turn in a generate call of its own (sent as it comes:
``arctic.group_quiet_ms=0``), and the calls of all trajectories join one running batch of the
server's sampler: the server the run uses (``arctic.url``) counts a call per turn and fewer than
half the decode steps the calls would need one at a time.
"""

from __future__ import annotations

import pytest
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

from adapter_suites import check_calls_share_steps, serving
from arctic_core.demo.task import CountingTask
from skyrl_run import counting_rows, logged_scalars, main_base_args, run_main_base, write_parquet

BATCH, N = 2, 4


def trained_rows(dump) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) of every row of SkyRL's dumped training batch."""
    data = TrainingInputBatch.load(TrainingInputBatch, str(dump))
    rows = []
    for tokens, real, response in zip(data["sequences"], data["attention_mask"], data["response_mask"], strict=True):
        sequence, length = tokens[real.bool()].tolist(), int(response.sum())
        rows.append((sequence[:-length], sequence[-length:]))
    return rows


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_turn_environment_trains_with_the_shared_turn_packed_once(policy, tmp_path):
    data = write_parquet(counting_rows(CountingTask(ops=("repeat",)), "counting_twice"), tmp_path / "task.parquet")
    extra = ("generator.step_wise_trajectories=true", "generator.max_turns=2", "trainer.ckpt_interval=-1",
             "trainer.dump_data_batch=true", "arctic.group_quiet_ms=0",  # a call per turn, not regrouped
             "trainer.algorithm.use_kl_loss=false")  # the server has no reference model
    with serving(policy) as url:
        args = main_base_args(policy, data, tmp_path, steps=1, batch=BATCH, n=N, entrypoint="counting_env",
                              extra=(*extra, f"arctic.url={url}"))
        result = run_main_base(args, cwd=tmp_path)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        check_calls_share_steps(url, calls=2 * BATCH * N)  # two turns per trajectory, one sample each

    rows = trained_rows(tmp_path / "exports" / "dumped_data" / "global_step_1_training_input.pkl")
    first_prompts = {tuple(prompt) for prompt, _ in rows if len(prompt) == min(len(p) for p, _ in rows)}
    second_turns = [prompt for prompt, _ in rows if tuple(prompt) not in first_prompts]
    assert len(rows) == 2 * BATCH * N and len(second_turns) == BATCH * N  # two turns per trajectory
    assert all(any(prompt[:len(first)] == list(first) for first in first_prompts) for prompt in second_turns)

    scalars = logged_scalars(tmp_path / "tensorboard")
    tokens, packed = scalars["policy/arctic/tokens"][1], scalars["policy/arctic/packed_tokens"][1]
    prompt_packed = scalars["policy/arctic/prompt_packed_tokens"][1]
    sequences = [prompt + response for prompt, response in rows]
    assert tokens == sum(map(len, sequences))
    assert packed == len({tuple(s[:k]) for s in sequences for k in range(1, len(s) + 1)})  # every prefix once
    shared_first_turn = sum(len(next(iter(first_prompts))) for _ in second_turns)
    assert packed <= prompt_packed - shared_first_turn, (tokens, prompt_packed, packed)

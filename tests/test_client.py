"""The client end to end, in process: the five calls, accumulation, checkpoints, lifecycle, errors."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient, AsyncArcticClient
from arctic_core.errors import ConfigError, PluginNotFoundError, RequestError

from helpers import PROMPTS, server_of, trainer_of, weights


def sampler_of(client: ArcticClient):
    return client.transport.server.sampler


def rollout(client: ArcticClient, n: int = 3, seed: int = 7) -> RolloutBatch:
    batch = client.generate(PROMPTS, n=n, max_tokens=6, seed=seed).batch
    rewards = torch.linspace(-1, 1, batch.num_responses)
    old = client.log_probs(batch).outputs["logprobs"]
    return batch.replace(old_logprobs=old, advantages=rewards, rewards=rewards)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=1e-6, msg=name)


def test_a_client_takes_a_yaml_file_as_its_config(arctic_config, tmp_path):
    config = arctic_config()
    path = tmp_path / "arctic.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    with ArcticClient.in_process(str(path)) as from_file, ArcticClient.in_process(config) as from_config:
        assert from_file.generate(PROMPTS, n=2, max_tokens=4, seed=1).batch.response_ids.tolist() == \
            from_config.generate(PROMPTS, n=2, max_tokens=4, seed=1).batch.response_ids.tolist()
    with pytest.raises(ConfigError, match="a config is an ArcticConfig, a dict or the path of a YAML file, got list"):
        ArcticClient.in_process([config])


def test_generate_returns_n_grouped_samples_with_sampling_logprobs(arctic_config):
    with ArcticClient.in_process(arctic_config()) as client:
        result = client.generate(PROMPTS, n=4, max_tokens=5, seed=3)
        batch = result.batch
        assert batch.num_prompts == 3 and batch.num_responses == 12
        assert batch.groups() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        assert batch.prompt(5) == PROMPTS[1] and int(batch.response_lens.max()) <= 5
        assert batch.policy_version.tolist() == [0] * 12
        assert result.metrics["generated_tokens"] == float(batch.response_lens.sum())
        assert result.metrics["tokens_per_s"] == pytest.approx(result.metrics["generated_tokens"]
                                                               / result.metrics["seconds"])
        assert result.metrics["peak_rss_gib"] > 0.1  # a process holding torch and two tiny models
        # The sampler's log-probs are the trainer's (same weights, temperature 1, no top-k/top-p).
        trainer_logp = client.log_probs(batch).outputs["logprobs"]
        torch.testing.assert_close(batch.sampling_logprobs, trainer_logp, atol=1e-5, rtol=0)
        # Same seed -> same samples.
        again = client.generate(PROMPTS, n=4, max_tokens=5, seed=3).batch
        assert torch.equal(again.response_ids, batch.response_ids)


def test_log_probs_equal_a_plain_per_sequence_forward(arctic_config, tiny_policy):
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    with ArcticClient.in_process(arctic_config(trainer={"micro_batch_tokens": 20})) as client:
        batch = client.generate(PROMPTS, n=2, max_tokens=6, seed=1).batch
        out = client.log_probs(batch, processors=["logprobs", "entropy"], temperature=0.7).outputs
    for i in range(batch.num_responses):
        prompt, response = batch.prompt(i), batch.response(i)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1] / 0.7
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        torch.testing.assert_close(out["logprobs"][i, : len(response)], expected, atol=1e-5, rtol=0)
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        torch.testing.assert_close(out["entropy"][i, : len(response)], entropy, atol=1e-5, rtol=0)
        assert out["logprobs"][i, len(response) :].abs().sum() == 0


def grads(client: ArcticClient) -> dict[str, torch.Tensor]:
    return trainer_of(client).full_gradients()


def assert_close_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-4) -> None:
    """Each tensor within ``rtol`` of the other, relative to the tensor's norm."""
    assert a.keys() == b.keys() and a
    for name in a:
        assert (a[name] - b[name]).norm() <= rtol * b[name].norm() + 1e-12, name


def test_fwd_bwd_accumulates_across_calls_until_step(arctic_config):
    """Two half-batch calls, each scaled by its token share, give the full batch's gradient."""
    loss = [{"name": "ppo", "clip_low": 0.2, "clip_high": 0.28}, {"name": "entropy", "weight": 0.01}]
    with ArcticClient.in_process(arctic_config()) as full:
        batch = rollout(full)
        full.fwd_bwd(batch, loss)
        expected = grads(full)
    with ArcticClient.in_process(arctic_config(trainer={"micro_batch_tokens": 16})) as split:
        halves = [batch.select(range(0, 5)), batch.select(range(5, batch.num_responses))]
        total = int(batch.loss_mask.sum())
        before = weights(split)
        for half in halves:
            split.fwd_bwd(half, loss, scale=int(half.loss_mask.sum()) / total)
        assert_close_relative(grads(split), expected)
        assert_same_weights(before, weights(split))  # nothing moves before step()
        metrics = split.step().metrics
        assert metrics["step"] == 1.0 and metrics["grad_norm"] > 0
        assert any(not torch.equal(before[k], v) for k, v in weights(split).items())


def test_sync_weights_moves_the_sampler_to_the_trainer(arctic_config):
    with ArcticClient.in_process(arctic_config(trainer={"optimizer": {"lr": 1e-2}})) as client:
        batch = rollout(client)
        client.fwd_bwd(batch, "ppo")
        client.step()
        sampler_state = sampler_of(client).model.state_dict()
        trained = weights(client)
        assert any(not torch.equal(sampler_state[k], trained[k]) for k in trained)
        result = client.sync_weights()
        assert result.policy_version == 1 and result.metrics["bytes"] > 0
        for name, tensor in trained.items():
            assert torch.equal(sampler_state[name], tensor), name
        assert client.generate(PROMPTS[:1], n=2, max_tokens=2).batch.policy_version.tolist() == [1, 1]


def test_a_failed_sync_leaves_the_policy_version_for_its_retry(arctic_config, monkeypatch):
    with ArcticClient.in_process(arctic_config()) as client:
        transport = server_of(client).weight_transport

        def lost(*args, **kwargs):
            raise RuntimeError("the link to the sampler dropped")

        monkeypatch.setattr(transport, "sync", lost)
        with pytest.raises(RuntimeError, match="dropped"):
            client.sync_weights()
        assert client.status().policy_version == 0
        monkeypatch.undo()
        assert client.sync_weights().policy_version == 1


def test_reference_log_probs_stay_at_the_initial_policy(arctic_config):
    with ArcticClient.in_process(arctic_config(reference={}, trainer={"optimizer": {"lr": 1e-2}})) as client:
        batch = rollout(client)
        ref_before = client.log_probs(batch, model="reference").outputs["logprobs"]
        torch.testing.assert_close(ref_before, batch.old_logprobs, atol=1e-6, rtol=0)
        client.fwd_bwd(batch.replace(ref_logprobs=ref_before), ["ppo", {"name": "kl", "weight": 0.1}])
        client.step()
        assert torch.equal(client.log_probs(batch, model="reference").outputs["logprobs"], ref_before)
        assert not torch.allclose(client.log_probs(batch).outputs["logprobs"], ref_before)


def test_checkpoint_resume_reproduces_the_next_step(arctic_config, tmp_path):
    config = arctic_config(trainer={"optimizer": {"lr": 1e-2},
                                    "scheduler": {"name": "linear", "total_steps": 10, "warmup_steps": 2}})
    with ArcticClient.in_process(config) as client:
        batch = rollout(client)
        client.fwd_bwd(batch, "ppo")
        client.step()
        status = client.save_checkpoint(str(tmp_path / "ckpt"), export_hf=True)
        assert status.step == 1 and (tmp_path / "ckpt" / "hf" / "config.json").is_file()
        first = client.fwd_bwd(batch, "ppo").metrics["loss"]
        lr_next = client.step().metrics["lr"]
        after = weights(client)
    with ArcticClient.in_process(config) as resumed:
        status = resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert status.step == 1 and status.policy_version == 1
        assert resumed.fwd_bwd(batch, "ppo").metrics["loss"] == pytest.approx(first, abs=1e-7)
        metrics = resumed.step().metrics
        assert metrics["lr"] == pytest.approx(lr_next) and metrics["step"] == 2
        assert_same_weights(weights(resumed), after, rtol=1e-6)


# A checkpoint's hyperparameters (those of OLD) and a config changed since (NEW): two decay groups
# in both, so the optimizer state fits; clipping well under the gradient norm, so it acts.
OLD = {"optimizer": {"lr": 1e-5, "weight_decay": 0.01, "decay": "transformers"}}
NEW = {"optimizer": {"lr": 1e-2, "weight_decay": 0.1, "decay": "transformers", "betas": [0.8, 0.95], "eps": 1e-6,
                     "max_grad_norm": 1e-3},
       "scheduler": {"name": "cosine", "total_steps": 10}}


def train(client: ArcticClient, batch: RolloutBatch, steps: int) -> tuple[list[tuple[int, float]], dict]:
    """Each step's (number, lr), and the weights after the last."""
    done = []
    for _ in range(steps):
        client.fwd_bwd(batch, "ppo")
        metrics = client.step().metrics
        assert metrics["grad_norm"] > NEW["optimizer"]["max_grad_norm"]
        done.append((int(metrics["step"]), metrics["lr"]))
    return done, weights(client)


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_a_loaded_checkpoint_trains_with_the_configured_hyperparameters(arctic_config, tmp_path, backend):
    """A load restores the weights, the optimizer's moments and the schedule's position; the
    configured lr schedule, weight decays, betas, eps and clipping apply from the next step, not
    those the checkpoint was saved with."""
    from arctic_zorro.lr_schedule import lr_factor

    new = arctic_config(trainer={"backend": backend, **NEW})
    with ArcticClient.in_process(arctic_config(trainer={"backend": backend, **OLD})) as client:
        batch = rollout(client)
        client.save_checkpoint(str(tmp_path / "start"))  # position 0, no moments yet
        train(client, batch, 2)
        client.save_checkpoint(str(tmp_path / "step2"))
    with ArcticClient.in_process(new) as fresh:
        expected_lrs, expected_weights = train(fresh, batch, 2)
    with ArcticClient.in_process(new) as resumed:
        resumed.load_checkpoint(str(tmp_path / "start"))
        lrs, after = train(resumed, batch, 2)  # as a fresh server with this config trains, bit for bit
        assert lrs == expected_lrs and all(torch.equal(after[name], expected_weights[name]) for name in after)
        assert resumed.load_checkpoint(str(tmp_path / "step2")).step == 2
        schedule = lr_factor(new.trainer.scheduler)  # resumed at its third step
        assert train(resumed, batch, 2)[0] == [(3, 1e-2 * schedule(2)), (4, 1e-2 * schedule(3))]


def test_the_hf_export_holds_the_tokenizer_and_generates_what_the_server_does(arctic_config, tiny_policy, tmp_path):
    """``export_hf`` writes a folder transformers loads whole: model, tokenizer with its chat
    template, generation config; greedy decoding there gives the server's tokens."""
    with ArcticClient.in_process(arctic_config(trainer={"optimizer": {"lr": 1e-2}})) as client:
        client.fwd_bwd(rollout(client), "ppo")
        client.step()
        client.sync_weights()
        client.save_checkpoint(str(tmp_path / "ckpt"), export_hf=True)
        served = client.generate(PROMPTS, n=1, temperature=0.0, max_tokens=8).batch
    export = tmp_path / "ckpt" / "hf"
    tokenizer, original = AutoTokenizer.from_pretrained(export), AutoTokenizer.from_pretrained(tiny_policy)
    assert len(tokenizer) == len(original) > 100
    assert tokenizer.chat_template == original.chat_template and tokenizer.eos_token == original.eos_token
    text = tokenizer.apply_chat_template([{"role": "user", "content": "count up from 7"}], tokenize=False)
    assert tokenizer.encode(text) == original.encode(text)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    assert model.generation_config.eos_token_id == original.eos_token_id
    for i, prompt in enumerate(PROMPTS):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert out[0, len(prompt):].tolist() == served.response(i)


def test_sleep_refuses_work_until_wake(arctic_config):
    with ArcticClient.in_process(arctic_config()) as client:
        client.sleep(["sampler"])
        with pytest.raises(RequestError, match=re.escape("the sampler is asleep; call wake(['sampler']) first")):
            client.generate(PROMPTS, n=1, max_tokens=2)
        client.wake(["sampler"])
        assert client.generate(PROMPTS, n=1, max_tokens=2).batch.num_responses == 3
        with pytest.raises(RequestError, match=r"engine\(s\) \['reference'\] not configured"):
            client.sleep(["reference"])
        client.sleep([])  # no engine named: none sleeps (None means every engine)
        assert client.generate(PROMPTS, n=1, max_tokens=2).batch.num_responses == 3


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_a_sleeping_trainer_or_reference_is_named_as_wake_takes_it(arctic_config, backend):
    engines = {"trainer": {"backend": backend}, "reference": {"backend": backend}}
    with ArcticClient.in_process(arctic_config(**engines)) as client:
        batch = rollout(client)
        client.fwd_bwd(batch, "ppo")
        client.sleep(["trainer", "reference"])
        asleep = "the {0} is asleep; call wake(['{0}']) first"
        for call in (lambda: client.log_probs(batch), lambda: client.fwd_bwd(batch, "ppo"), client.step):
            with pytest.raises(RequestError, match=re.escape(asleep.format("trainer"))):
                call()
        with pytest.raises(RequestError, match=re.escape(asleep.format("reference"))):
            client.log_probs(batch, model="reference")
        client.wake(["trainer", "reference"])
        assert client.step().metrics["step"] == 1.0
        client.log_probs(batch, model="reference")


def test_colocated_engines_sleep_between_calls_and_give_the_same_results(arctic_config):
    """``colocate: true``: before each call only the engines it needs are awake, and the demo's
    GRPO loop gives exactly the numbers of a server whose engines never sleep."""
    from test_http import assert_same_loop, grpo_loop

    engines = {"trainer": {"backend": "torch"}, "reference": {"backend": "torch"}}
    with ArcticClient.in_process(arctic_config(**engines)) as plain:
        expected = grpo_loop(plain)
    with ArcticClient.in_process(arctic_config(**engines, colocate=True)) as client:
        server = client.transport.server
        assert_same_loop(expected, grpo_loop(client))
        assert server.asleep == {"reference"}  # the loop ended with a sync: trainer and sampler awake
        batch = client.generate(PROMPTS, n=2, max_tokens=3).batch
        assert server.asleep == {"trainer", "reference"} and server.trainer.asleep
        client.log_probs(batch, model="reference")
        assert server.asleep == {"trainer", "sampler"} and server.sampler.engine.asleep
        client.sleep()  # the client may still put everything to sleep itself
        assert server.asleep == {"trainer", "sampler", "reference"}


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(arctic_config):
    with ArcticClient.in_process(arctic_config()) as client:
        batch = rollout(client)
        with pytest.raises(PluginNotFoundError, match="no loss named 'pp0'.*ppo"):
            client.fwd_bwd(batch, "pp0")
        with pytest.raises(RequestError, match=r"SamplingParams\):\n  n: Input should be greater than or equal to 1"):
            client.generate(PROMPTS, n=0)
        with pytest.raises(RequestError, match=r"max_token: unknown key \(did you mean 'max_tokens'\?\); "
                                               r"valid keys: .*max_tokens, min_p, n,"):
            client.generate(PROMPTS, max_token=3)
        with pytest.raises(RequestError, match="prompts.0: List should have at least 1 item"):
            client.generate([[]], n=1)
        with pytest.raises(RequestError, match="token id 100000 >= vocab size"):
            client.generate([[1, 100000]], n=1)
        too_long = RolloutBatch.from_lists([[1] * 500], [[2] * 20], [0])
        with pytest.raises(RequestError, match="response 0 with its prompt has 520 tokens, more than the model's "
                                               "max_position_embeddings=512"):
            client.log_probs(too_long)
        with pytest.raises(RequestError, match="no reference engine is configured"):
            client.log_probs(batch, model="reference")
        with pytest.raises(RequestError, match="loss.*at least 1 item"):
            client.fwd_bwd(batch, [])
        with pytest.raises(Exception, match="old_logprobs"):
            client.fwd_bwd(batch.replace(old_logprobs=None), "ppo")
        with pytest.raises(RequestError, match="unknown operation 'train'"):
            client.transport.call("train", None)
        assert client.generate(PROMPTS, n=1, max_tokens=2).batch.num_responses == 3


class Recorder:
    """A transport that answers each call with its request: what the client would send."""

    def call(self, op, request):
        return request


def test_prompt_token_ids_are_strict_ints_and_tensor_prompts_become_them():
    """A tensor's or an array's rows arrive as ints; a bool, a numeric string or a float is no token
    id (lax ints took them as 1, 2 and 2), and each refusal names its place."""
    client = ArcticClient(Recorder())
    sent = client.generate(torch.tensor([[1, 2], [3, 4]]), stop_token_ids=[5]).prompts
    assert sent == [[1, 2], [3, 4]] and all(type(t) is int for p in sent for t in p)
    assert client.generate([np.array([7, 8], dtype=np.int32), (9,)]).prompts == [[7, 8], [9]]
    assert client.generate([list(np.array([3, 4])), [torch.tensor(5)]]).prompts == [[3, 4], [5]]  # integer scalars
    for prompts, where in (([[1, True]], "prompts.0.1"), ([[1], ["2"]], "prompts.1.0"), ([[2.0]], "prompts.0.0"),
                           ([torch.tensor([True])], "prompts.0.0"), ([[np.float64(3)]], "prompts.0.0")):
        with pytest.raises(RequestError, match=rf"{where}: Input should be a valid integer"):
            client.generate(prompts)
    with pytest.raises(RequestError, match="prompts.0.0: Input should be greater than or equal to 0"):
        client.generate([[-1]])
    with pytest.raises(RequestError, match="stop_token_ids.0: Input should be a valid integer"):
        client.generate([[1]], stop_token_ids=[True])


def test_text_or_a_single_unwrapped_prompt_is_one_short_error():
    """The two mistakes a tokenizer-less first call makes: text, and one prompt's ids not wrapped
    in a list of prompts. A request with many bad values lists ten of them."""
    client = ArcticClient(Recorder())
    with pytest.raises(RequestError, match=r"^prompts\[1\] is text: generate\(\) takes token ids \(tokenize first"):
        client.generate([[1, 2], "What is 12 * 7?"])
    with pytest.raises(RequestError, match=r"^prompts is a list of token ids: .* \(one prompt: \[\[\.\.\.\]\]\)"):
        client.generate([1, 20, 30])
    with pytest.raises(RequestError) as many:
        client.generate([[0.5] * 100])
    lines = str(many.value).splitlines()
    assert len(lines) == 12 and lines[-1] == "  ... and 90 more problems"


@pytest.mark.parametrize("sampler", ["embedded", "hf-generate"])
def test_every_sampler_refuses_a_prompt_without_room_for_its_new_tokens(arctic_config, sampler):
    with ArcticClient.in_process(arctic_config(sampler={"backend": sampler})) as client:
        with pytest.raises(RequestError,
                           match=r"prompts\[0\] \(505 tokens\) \+ max_tokens=10 exceeds max_model_len=512"):
            client.generate([[1] * 505], n=1, max_tokens=10)


def test_log_probs_take_a_single_processor_name_as_a_string(arctic_config):
    with ArcticClient.in_process(arctic_config()) as client:
        batch = client.generate(PROMPTS, n=1, max_tokens=4, seed=0).batch
        both = client.log_probs(batch, processors=["logprobs", "entropy"]).outputs
        alone = client.log_probs(batch, processors="entropy").outputs
    assert alone.keys() == {"entropy"} and torch.equal(alone["entropy"], both["entropy"])


def test_leaving_the_block_after_an_explicit_shutdown_is_quiet(arctic_config):
    with ArcticClient.in_process(arctic_config()) as client:
        client.shutdown()
    assert server_of(client).closed

    async def main() -> AsyncArcticClient:
        async with AsyncArcticClient.in_process(arctic_config()) as client:
            await client.shutdown()
        return client

    assert server_of(asyncio.run(main())).closed


def test_async_client_runs_calls_concurrently_and_serialises_them(arctic_config):
    async def main():
        async with AsyncArcticClient.in_process(arctic_config()) as client:
            results = await asyncio.gather(*(client.generate(PROMPTS, n=2, max_tokens=3, seed=s) for s in range(4)))
            batch = results[0].batch.replace(advantages=torch.ones(6))
            batch = batch.replace(old_logprobs=(await client.log_probs(batch)).outputs["logprobs"])
            await client.fwd_bwd(batch, "ppo")
            step = await client.step()
            version = (await client.sync_weights()).policy_version
            return results, step, version

    results, step, version = asyncio.run(main())
    assert [r.batch.num_responses for r in results] == [6, 6, 6, 6]
    assert step.metrics["step"] == 1.0 and version == 1


def test_keep_last_prunes_older_checkpoints_only(arctic_config, tmp_path):
    (tmp_path / "notes").mkdir()  # not a checkpoint: must survive
    with ArcticClient.in_process(arctic_config(trainer={"backend": "torch"})) as client:
        batch = rollout(client)
        for step in range(4):
            client.fwd_bwd(batch, "ppo")
            client.step()
            client.save_checkpoint(str(tmp_path / f"step-{step}"), keep_last=2)
        with pytest.raises(RequestError, match="keep_last: Input should be greater than or equal to 1"):
            client.save_checkpoint(str(tmp_path / "bad"), keep_last=0)
        for call in (client.save_checkpoint, client.load_checkpoint):  # a step number is no folder
            with pytest.raises(RequestError, match="path: a checkpoint folder's path .* got int 5"):
                call(5)
        client.load_checkpoint(tmp_path / "step-3")  # a pathlib.Path is one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-2", "step-3"]


def test_a_damaged_checkpoint_is_refused_and_look_alike_folders_are_left_alone(arctic_config, tmp_path):
    target = tmp_path / "ckpt"
    (tmp_path / ".ckpt.tmp-notapid").mkdir()  # a user's folder named like a staging folder
    with ArcticClient.in_process(arctic_config(trainer={"backend": "torch"})) as client:
        batch = rollout(client)
        client.fwd_bwd(batch, "ppo")
        client.step()
        for _ in range(2):  # the second save replaces the first
            client.save_checkpoint(str(target))
        weights = target / "trainer" / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        with pytest.raises(RequestError, match=f"checkpoint {target / 'trainer'}: cannot load model from"):
            client.load_checkpoint(str(target))
        client.fwd_bwd(batch, "ppo")  # the server goes on, its state as it was
        assert client.step().metrics["step"] == 2.0
        with pytest.raises(RequestError, match="loss must be a term .* or a list of them, got int"):
            client.fwd_bwd(batch, 3)
    assert (tmp_path / ".ckpt.tmp-notapid").is_dir()


def test_a_cuda_device_on_a_machine_without_one_is_a_config_error(tiny_policy, monkeypatch):
    from arctic_core.config import ModelConfig
    from arctic_core.errors import ConfigError
    from arctic_core.hf import load_causal_lm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="the model's device 'cuda:0': no CUDA device is visible on this machine"):
        load_causal_lm(ModelConfig(path=str(tiny_policy), device="cuda:0"))

"""The embedded engine against transformers: greedy equality, prefill-once, sampling, lifecycle, errors."""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from arctic_core.config import ModelConfig, SamplerConfig, SamplingParams, validate
from arctic_core.demo.task import CountingTask
from arctic_core.demo.tiny_model import build_tiny_model, build_tokenizer
from arctic_core.errors import ConfigError, RequestError
from arctic_fca.engine import EmbeddedEngine, EngineOptions, attention
from arctic_fca.engine.sampling import RowParams, filtered_log_probs
from arctic_fca.hf_sampler import HFGenerateSampler



@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(CountingTask().corpus())


def make_engine(tokenizer, family="qwen3", seed=1, **options):
    model = build_tiny_model(tokenizer, family=family, seed=seed)
    reference = copy.deepcopy(model)
    return EmbeddedEngine(model, EngineOptions(**{"kv_cache_tokens": 4096, **options})), reference


def random_prompts(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model, prompt, max_tokens):
    ids = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, pad_token_id=0)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("mode", ["fca", "plain"])
def test_greedy_equals_transformers_generate(tokenizer, family, mode):
    engine, reference = make_engine(tokenizer, family, fca=mode)
    prompts = random_prompts((5, 16, 23, 40, 7), len(tokenizer))
    outputs = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.prompt_index for o in outputs] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    for out in outputs:
        assert out.tokens == hf_greedy(reference, prompts[out.prompt_index], 24)
    if mode == "fca":  # the shared prompts really went through the cascade
        assert engine.stats.fca_steps == engine.stats.decode_steps == 23


def test_a_group_prefills_its_prompt_once_and_shared_prefixes_are_reused(tokenizer):
    engine, reference = make_engine(tokenizer, fca="fca")
    system = random_prompts((32,), len(tokenizer), seed=5)[0]  # two full blocks shared by both prompts
    prompts = [system + tail for tail in random_prompts((9, 20), len(tokenizer), seed=6)]
    outputs = engine.generate(prompts, SamplingParams(n=8, temperature=0, max_tokens=10, ignore_eos=True))
    # Each prompt once (not 8 times), and the second prompt's system blocks came from the first.
    assert engine.stats.prefill_tokens == sum(map(len, prompts)) - 32
    assert engine.stats.prefix_hit_tokens == 32
    for out in outputs:
        assert out.tokens == hf_greedy(reference, prompts[out.prompt_index], 10)
    assert engine.pool.num_free == engine.pool.capacity  # every block came back


def test_identical_prompts_in_one_call_share_their_blocks(tokenizer):
    # Whole blocks only (32 tokens): the copies join the first one's group, so the prompt is
    # computed once for the six samples (no copy recomputes its last block).
    engine, reference = make_engine(tokenizer)
    prompt = random_prompts((32,), len(tokenizer), seed=1)[0]
    outputs = engine.generate([prompt, prompt, prompt], SamplingParams(n=2, temperature=0, max_tokens=6,
                                                                       ignore_eos=True))
    assert all(o.tokens == hf_greedy(reference, prompt, 6) for o in outputs) and len(outputs) == 6
    assert engine.stats.prefix_hit_tokens == 0 and engine.stats.prefill_tokens == 32
    assert engine.pool.num_free == engine.pool.capacity


def test_finished_samples_leave_their_blocks_findable_for_the_next_turn(tokenizer):
    # A multi-turn rollout sends the conversation so far as the next prompt: its blocks from the
    # turn before (prompt and answer, but the answer's last token, whose K/V were never written)
    # are found in the cache until their memory is needed or the weights change.
    engine, reference = make_engine(tokenizer)
    prompt = random_prompts((20,), len(tokenizer), seed=3)[0]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    (answer,) = engine.generate([prompt], greedy)
    turn = prompt + answer.tokens + random_prompts((7,), len(tokenizer), seed=4)[0]
    hits = engine.stats.prefix_hit_tokens
    (out,) = engine.generate([turn], greedy)
    assert engine.stats.prefix_hit_tokens - hits == (20 + 30 - 1) // 16 * 16
    assert out.tokens == hf_greedy(reference, turn, 30)
    # A weight update, even one that fails halfway, forgets every cached prefix (their K/V are stale).
    def nothing_found():
        hits = engine.stats.prefix_hit_tokens
        engine.generate([turn], greedy)
        return engine.stats.prefix_hit_tokens == hits and engine.pool.num_free == engine.pool.capacity

    with pytest.raises(RequestError, match="model.nope"):
        engine.update_weights([("model.nope", torch.zeros(1))], version=1)
    assert nothing_found()
    engine.update_weights(reference.state_dict().items(), version=1)
    assert nothing_found()
    # A cache of 8 blocks: every call takes blocks that earlier ones left findable.
    small, reference = make_engine(tokenizer, kv_cache_tokens=9 * 16)
    prompts = random_prompts((40, 33, 47, 20, 40), len(tokenizer), seed=5)
    for prompt in prompts + prompts[::-1]:
        (out,) = small.generate([prompt], greedy)
        assert out.tokens == hf_greedy(reference, prompt, 30)
        assert small.pool.num_free == small.pool.capacity


@pytest.mark.parametrize("max_num_seqs, waves", [(4, 3), (64, 2)])
def test_continuous_batching_admits_groups_as_blocks_free_up(tokenizer, max_num_seqs, waves, caplog):
    # worst_case: 20 blocks hold about two groups' max_tokens at a time: the rest wait and run as
    # earlier ones finish. With no limit on sequences (64), an admitted group must keep room for its
    # samples' blocks until its prompt is prefilled and forked, or a later group takes them.
    engine, reference = make_engine(tokenizer, kv_cache_tokens=20 * 16, max_num_seqs=max_num_seqs,
                                    admission="worst_case")
    prompts = random_prompts((18, 30, 12, 25, 40), len(tokenizer), seed=2)
    params = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="arctic_fca.engine.engine"):
        outputs = engine.generate(prompts, params)
    for out in outputs:
        assert out.tokens == hf_greedy(reference, prompts[out.prompt_index], 20)
    assert engine.stats.prefill_steps >= waves  # admitted in waves, not all at once
    assert engine.pool.num_free == engine.pool.capacity and engine.scheduler.reserved == 0
    assert engine.stats.preempted == 0
    # The waves are said once, with the setting that would avoid them, then counted.
    # Blocks per group: its prompt's plus 2 samples' own (2+4, 2+6, 1+4, 2+4, 3+4) = 32; the pool
    # lends 19 of its 20 (block 0 is the scratch block padding rows write).
    why = "10 samples exceed max_num_seqs=4" if max_num_seqs == 4 else \
        "they need 512 KV cache tokens and the cache holds 304 (raise gpu_memory_utilization or kv_cache_tokens)"
    assert [r.getMessage() for r in caplog.records] == [
        f"the 5 prompt groups of this call cannot all run at once: {why}; they run in waves, each decoding to its end"]
    engine.generate(prompts, params)
    engine.generate(prompts[:1], params)  # fits: not counted
    assert engine.stats.calls_in_waves == 2 and len(caplog.records) == 1


@pytest.mark.parametrize(("chunked", "fused_decoder", "fca"), [(False, True, "fca"), (True, True, "fca"),
                                                               (False, False, "plain")])
def test_samples_take_blocks_as_they_grow_and_the_newest_are_preempted_when_the_cache_runs_out(
        tokenizer, chunked, fused_decoder, fca, caplog):
    # on_demand (the default): 16 blocks admit groups by their prompts. Samples that run to
    # max_tokens then outgrow the cache, and the newest are preempted: their blocks go back and their
    # prefill later recomputes their tokens so far and draws their next one. Greedy tokens must be
    # generate's, sampled log-probs the model's on each sample's tokens, and every block must return.
    engine, reference = make_engine(tokenizer, kv_cache_tokens=16 * 16, max_num_seqs=64, fca=fca,
                                    fused_decoder=fused_decoder, chunked_prefill=chunked, max_prefill_tokens=32)
    prompts = random_prompts((18, 30, 12, 25, 40), len(tokenizer), seed=2)
    with caplog.at_level(logging.WARNING, logger="arctic_fca.engine.engine"):
        outputs = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=32, ignore_eos=True))
    assert [o.prompt_index for o in outputs] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    for out in outputs:
        assert out.tokens == hf_greedy(reference, prompts[out.prompt_index], 32)
    preempted = engine.stats.preempted
    assert preempted >= 2 and engine.stats.calls_in_waves == 0
    assert engine.stats.prefix_hit_tokens > 0  # resumed samples found blocks they left
    assert engine.stats.generated_tokens == 10 * 32  # a preempted sample's dropped token is not counted twice
    assert engine.pool.num_free == engine.pool.capacity and engine.scheduler.reserved == 0
    params = SamplingParams(n=3, temperature=1.0, max_tokens=36, ignore_eos=True, seed=7)
    for out in engine.generate(prompts, params):
        assert len(out.tokens) == 36
        expected = teacher_forced_logprobs(reference, prompts[out.prompt_index], out.tokens, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
    # The repetition penalty of a resumed sample counts the tokens it drew before its preemption:
    # the same tokens as in a cache that holds every sample.
    params = SamplingParams(n=2, temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=1e3)
    roomy, _ = make_engine(tokenizer, fca=fca, fused_decoder=fused_decoder)
    assert [o.tokens for o in engine.generate(prompts, params)] == [o.tokens for o in roomy.generate(prompts, params)]
    assert engine.stats.preempted > preempted + 2
    assert engine.pool.num_free == engine.pool.capacity
    # Said once, with the setting to raise, then counted.
    assert len(caplog.records) == 1
    assert re.fullmatch(r"the KV cache ran out of blocks: \d+ running samples were preempted, to be recomputed "
                        r"when blocks free up \(raise gpu_memory_utilization or kv_cache_tokens\)",
                        caplog.records[0].getMessage())


@pytest.mark.parametrize("trial", range(32))
def test_random_rollouts_in_a_tight_cache_equal_those_in_a_roomy_one(tokenizer, trial):
    # Prompt lengths around block boundaries, 1 to 4 samples, 1 to 33 new tokens, a shared system
    # prompt or none, stop tokens or none, in a cache barely holding one group's worst case (so
    # groups queue and samples are preempted): greedy tokens equal a roomy cache's, sampled
    # log-probs are the model's, and every block comes back.
    rng = random.Random(trial)
    n, max_tokens = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 15, 17, 33, 33])
    prompts = random_prompts([rng.choice([1, 15, 16, 17, 31, 32, 40]) for _ in range(rng.randint(3, 6))],
                             len(tokenizer), seed=trial)
    if rng.random() < 0.5:
        prompts = [random_prompts((32,), len(tokenizer), seed=1000 + trial)[0] + p for p in prompts]
    stops = list(range(3, 23)) if rng.random() < 0.5 else []
    options = dict(max_num_seqs=rng.choice([4, 64]), chunked_prefill=rng.random() < 0.3,
                   max_prefill_tokens=rng.choice([16, 48, 4096]), fca=rng.choice(["fca", "plain"]),
                   fused_decoder=rng.random() < 0.7, overlap_steps=rng.random() < 0.8)
    roomy, reference = make_engine(tokenizer, **options)
    worst = max(roomy.scheduler.worst_case_blocks(len(p), n, max_tokens) for p in prompts)
    tight, _ = make_engine(tokenizer, kv_cache_tokens=(worst + 1 + rng.randint(0, 2)) * 16,
                           admission="worst_case" if trial % 4 == 3 else "on_demand", **options)
    greedy = SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stops)
    assert [(o.prompt_index, o.tokens) for o in tight.generate(prompts, greedy)] == \
        [(o.prompt_index, o.tokens) for o in roomy.generate(prompts, greedy)]
    sampled = greedy.model_copy(update={"temperature": 1.0, "seed": trial})
    for out in tight.generate(prompts, sampled):
        expected = teacher_forced_logprobs(reference, prompts[out.prompt_index], out.tokens, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
    assert tight.pool.num_free == tight.pool.capacity and tight.scheduler.reserved == 0


@pytest.mark.parametrize("overlap_steps", [True, False])
@pytest.mark.parametrize("mode", ["fca", "plain"])
@pytest.mark.parametrize("max_num_seqs", [64, 5])
def test_samples_that_finish_leave_the_batch_while_the_others_decode_on(tokenizer, overlap_steps, mode, max_num_seqs,
                                                                        monkeypatch):
    # Prompts whose greedy samples stop at different steps: each prompt's tokens equal its rollout
    # alone, cut at its first stop token, and when every group runs at once one run of decode steps
    # goes through every finish (with 5 samples at most, groups wait: decode stops to admit them).
    # A repetition penalty bans a sample's earlier tokens, so each step's token depends on the per-row
    # state that the smaller batch must keep in the right rows.
    engine, _ = make_engine(tokenizer, fca=mode, overlap_steps=overlap_steps, max_num_seqs=max_num_seqs)
    prompts = random_prompts((5, 16, 23, 40, 7, 31), len(tokenizer), seed=5)
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1e3)
    alone = [engine.generate([p], params)[0].tokens for p in prompts]
    stops = {tokens[2 + 3 * i] for i, tokens in enumerate(alone)}
    expected = [next(tokens[: k + 1] for k, t in enumerate(tokens) if t in stops or k == len(tokens) - 1)
                for tokens in alone]
    assert len({len(tokens) for tokens in expected}) >= 4  # they finish at different steps

    runs, decode = [], engine._decode
    monkeypatch.setattr(engine, "_decode", lambda *args, **kwargs: runs.append(1) or decode(*args, **kwargs))
    outputs = engine.generate(prompts, params.model_copy(update={"stop_token_ids": sorted(stops)}))
    assert [o.tokens for o in outputs] == [tokens for tokens in expected for _ in range(2)]
    assert len(runs) == 1 if max_num_seqs == 64 else len(runs) > 1
    assert engine.pool.num_free == engine.pool.capacity and engine.scheduler.reserved == 0


def test_samples_that_stop_early_run_more_at_once_when_blocks_are_lent_on_demand(tokenizer):
    # max_tokens 48 but most samples stop within a few tokens: reserving each sample's 48 tokens
    # admits about two groups at a time, lending blocks as samples grow several more. Which samples
    # run long depends on the draws, and those on the schedule: decode steps are summed over seeds.
    prompts = random_prompts((18, 30, 12, 25, 40, 9, 22, 15), len(tokenizer), seed=3)
    most_running, decode_steps = {}, {}
    for admission in ("worst_case", "on_demand"):
        engine, reference = make_engine(tokenizer, kv_cache_tokens=40 * 16, max_num_seqs=64, admission=admission)
        lengths = []
        for seed in (11, 12, 13, 14):
            params = SamplingParams(n=4, temperature=1.0, max_tokens=48, stop_token_ids=list(range(3, 30)), seed=seed)
            outputs = engine.generate(prompts, params)
            lengths += [len(o.tokens) for o in outputs]
            for out in outputs[::3]:
                assert not set(out.tokens[:-1]) & set(params.stop_token_ids)
                expected = teacher_forced_logprobs(reference, prompts[out.prompt_index], out.tokens, 1.0)
                torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
            assert engine.pool.num_free == engine.pool.capacity
        lengths.sort()
        assert lengths[-1] > 30 and lengths[len(lengths) // 2] < 12  # most stop early, a few run long
        most_running[admission], decode_steps[admission] = engine.stats.most_running, engine.stats.decode_steps
    assert most_running["worst_case"] <= 10 < 16 <= most_running["on_demand"]
    assert decode_steps["on_demand"] < 0.85 * decode_steps["worst_case"]


def test_a_tight_cache_does_not_preempt_the_same_samples_over_and_over(tokenizer):
    # 256 samples that mostly stop early in a cache that holds about 55 at once. A preempted sample
    # resumes as a group of one, whose worst case is small: let in without a block of headroom per
    # running sample, it soon ran the cache dry again, and the newest samples were preempted and
    # recomputed again and again (116 preemptions of 54 samples here, one of them 7 times).
    prompts = random_prompts([20, 30, 12, 25, 40, 9, 22, 15] * 4, len(tokenizer), seed=0)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=64, stop_token_ids=list(range(3, 20)), seed=3)
    engine, reference = make_engine(tokenizer, kv_cache_tokens=120 * 16, max_num_seqs=256)
    outputs = engine.generate(prompts, params)
    assert engine.stats.most_running >= 48 and engine.stats.preempted <= 8
    for out in outputs[::16]:
        expected = teacher_forced_logprobs(reference, prompts[out.prompt_index], out.tokens, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
    assert engine.pool.num_free == engine.pool.capacity


def test_stop_tokens_end_a_sample_and_are_kept(tokenizer):
    engine, reference = make_engine(tokenizer)
    prompt = random_prompts((12,), len(tokenizer))[0]
    expected = hf_greedy(reference, prompt, 16)
    stop = expected[5]
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop]))
    assert out.tokens == expected[: expected.index(stop) + 1]


def test_the_models_eos_ends_a_sample_besides_the_requests_stop_ids_unless_ignore_eos(tokenizer, tmp_path):
    """vLLM's rule, on the embedded engine and the transformers sampler: a request's stop ids add to
    the model's end-of-sequence ids; ``ignore_eos`` leaves only the stop ids and max_tokens."""
    engine, reference = make_engine(tokenizer)
    prompt = random_prompts((12,), len(tokenizer), seed=11)[0]
    expected = hf_greedy(reference, prompt, 16)
    eos, stop = expected[0], expected[-1]  # greedy gives 123, 123, 144, ...: the two stop it in different places
    assert expected.index(eos) < expected.index(stop)
    reference.generation_config.eos_token_id = engine.model.generation_config.eos_token_id = eos
    reference.save_pretrained(tmp_path)
    hf = HFGenerateSampler(SamplerConfig(backend="hf-generate"), ModelConfig(path=str(tmp_path), device="cpu"), seed=0)

    def through_first(ids):
        return expected[: min(expected.index(t) for t in ids) + 1]

    for ignore_eos, ends in ((False, [eos, stop]), (True, [stop])):
        params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop], ignore_eos=ignore_eos)
        (out,) = engine.generate([prompt], params)
        assert out.tokens == through_first(ends), ignore_eos
        assert hf.generate([prompt], params).response(0) == through_first(ends), ignore_eos
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert engine.generate([prompt], params)[0].tokens == hf.generate([prompt], params).response(0) == expected


def teacher_forced_logprobs(model, prompt, tokens, temperature):
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_queued_steps_give_the_tokens_of_one_step_at_a_time(tokenizer):
    prompts = random_prompts((18, 30, 12, 25, 40, 9), len(tokenizer), seed=4)
    params = [SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, max_tokens=14, ignore_eos=True, seed=3),
              SamplingParams(n=2, temperature=0.8, max_tokens=12, ignore_eos=True, seed=4,
                             repetition_penalty=1.4)]
    results = {}
    for overlap in (True, False):
        engine, _ = make_engine(tokenizer, kv_cache_tokens=24 * 16, max_num_seqs=6, overlap_steps=overlap)
        results[overlap] = [[(o.tokens, o.logprobs) for o in engine.generate(prompts, p)] for p in params]
        assert engine.stats.prefill_steps >= 4  # both calls admitted in waves, as blocks came back
    assert results[True] == results[False]


@pytest.mark.parametrize("n", [1, 100, 128, 129, 300])
def test_prompt_attention_over_padded_lengths_equals_the_unpadded(n):
    # The GPU prefill runs cuDNN's attention over q/k/v padded to a few lengths; the padding itself
    # must not change a real row (checked here in fp32 on the CPU's SDPA).
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(1, 4, n, 16, generator=gen)
    k, v = (torch.randn(1, 2, n, 16, generator=gen) for _ in range(2))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    out = attention.padded_causal_attention(q, k, v, 0.25, gqa=True)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_prefill_passes_are_queued_before_the_samples_of_the_one_before_are_read(tokenizer, monkeypatch):
    # 40 prompt tokens per pass: the 6 prompts (two sharing a system prompt) take several passes. With
    # overlap_steps each pass is queued before the host reads the samples of the pass before; the
    # tokens and log-probs (sampled, seeded) must be those of reading each pass before the next.
    from arctic_fca.engine import engine as engine_module

    vocab = len(tokenizer)
    system = random_prompts((20,), vocab, seed=7)[0]
    prompts = ([system + tail for tail in random_prompts((9, 14), vocab, seed=8)]
               + random_prompts((18, 30, 12, 25), vocab))
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, ignore_eos=True, seed=2)
    events, read = [], engine_module.TokensInFlight.read
    monkeypatch.setattr(engine_module.TokensInFlight, "read", lambda self: events.append("read") or read(self))
    results = {}
    for overlap in (True, False):
        engine, _ = make_engine(tokenizer, max_num_seqs=64, max_prefill_tokens=40, overlap_steps=overlap)
        prefill = engine.runner.prefill
        engine.runner.prefill = lambda *args, **kwargs: events.append("pass") or prefill(*args, **kwargs)  # noqa: B023 (called only by this iteration's generate)
        events.clear()
        results[overlap] = [(o.tokens, o.logprobs) for o in engine.generate(prompts, params)]
        passes = events.count("pass")
        assert passes >= 4 and engine.stats.prefill_steps == passes
        before_decode = events[: events.index("pass", 0) + 2 * passes]  # the passes and their reads
        expected = ["pass"] + ["pass", "read"] * (passes - 1) + ["read"] if overlap else ["pass", "read"] * passes
        assert before_decode == expected
        assert engine.pool.num_free == engine.pool.capacity
    assert results[True] == results[False]


def test_samples_stopping_while_the_next_step_is_queued_are_exact(tokenizer):
    # The host learns of a stop one step late; the finished sample's queued token is dropped and its
    # blocks go to waiting groups while that step may still write them. Every sample must end at its
    # first stop token, and each log-prob must be the model's on exactly that sample's tokens.
    engine, reference = make_engine(tokenizer, kv_cache_tokens=24 * 16, max_num_seqs=6)
    prompts = random_prompts((18, 30, 12, 25, 40, 9), len(tokenizer), seed=4)
    stops = list(range(3, 60))
    outputs = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=20, stop_token_ids=stops,
                                                      ignore_eos=True, seed=5))
    assert len({len(o.tokens) for o in outputs}) >= 4  # stops at many different steps
    for out in outputs:
        assert not set(out.tokens[:-1]) & set(stops)
        assert out.tokens[-1] in stops or len(out.tokens) == 20
        expected = teacher_forced_logprobs(reference, prompts[out.prompt_index], out.tokens, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
    assert engine.pool.num_free == engine.pool.capacity


@pytest.mark.parametrize(("chunked", "fused_decoder"), [(True, True), (True, False), (False, True)])
def test_prompts_prefill_in_chunks_while_running_samples_decode(tokenizer, chunked, fused_decoder):
    # 16 prompt tokens per prefill step: long prompts span several steps, and (chunked) each step also
    # decodes one token of every running sample. Later prompts read the system prompt's blocks that
    # an earlier prompt's chunks computed. Greedy tokens must be generate's, sampled log-probs the model's.
    vocab = len(tokenizer)
    system = random_prompts((32,), vocab, seed=5)[0]
    prompts = [system + tail for tail in random_prompts((9, 20, 3), vocab, seed=6)] + random_prompts((40, 12), vocab)
    engine, reference = make_engine(tokenizer, kv_cache_tokens=24 * 16, max_num_seqs=6, max_prefill_tokens=16,
                                    fca="fca", fused_decoder=fused_decoder, chunked_prefill=chunked)
    greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True))
    for out in greedy:
        assert out.tokens == hf_greedy(reference, prompts[out.prompt_index], 12)
    stats = engine.stats
    assert stats.prefix_hit_tokens == 2 * 32 and stats.prefill_tokens == sum(map(len, prompts)) - 2 * 32
    if chunked:
        assert stats.prefill_steps >= stats.prefill_tokens / 16 and stats.mixed_steps >= 3
    else:
        assert stats.mixed_steps == 0
    stops = list(range(3, 40))
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, stop_token_ids=stops, seed=2)
    sampled = engine.generate(prompts, params)
    assert len({len(o.tokens) for o in sampled}) >= 3
    for out in sampled:
        assert not set(out.tokens[:-1]) & set(stops)
        expected = teacher_forced_logprobs(reference, prompts[out.prompt_index], out.tokens, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
    assert engine.pool.num_free == engine.pool.capacity


def test_sampling_log_probs_are_those_of_the_distribution_sampled_from(tokenizer):
    engine, reference = make_engine(tokenizer)
    prompts = random_prompts((10, 21), len(tokenizer), seed=3)
    params = SamplingParams(n=3, temperature=0.7, max_tokens=12, ignore_eos=True, seed=11)
    outputs = engine.generate(prompts, params)
    for out in outputs:
        expected = teacher_forced_logprobs(reference, prompts[out.prompt_index], out.tokens, 0.7)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
    # Same seed, same samples; another seed, other samples.
    assert [o.tokens for o in engine.generate(prompts, params)] == [o.tokens for o in outputs]
    other = engine.generate(prompts, params.model_copy(update={"seed": 12}))
    assert [o.tokens for o in other] != [o.tokens for o in outputs]


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.4, 0.3, 0.2, 0.1]]))
    params = RowParams(temperature=torch.tensor([1.0, 1.0, 0.0]), top_k=torch.tensor([2, 0, 1]),
                       top_p=torch.tensor([1.0, 0.8, 0.5]))
    probs = filtered_log_probs(logits, params).exp()
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0, 0]))  # top-2, renormalised
    torch.testing.assert_close(probs[1], torch.tensor([0.625, 0.375, 0, 0]))  # 0.5 + 0.3 reaches 0.8
    torch.testing.assert_close(probs[2], torch.tensor([0.4, 0.3, 0.2, 0.1]))  # greedy rows keep the raw distribution


def test_filters_keep_or_drop_a_tie_whole():
    """Top-k keeps every entry equal to the k-th largest, as transformers' top-k does; top-p keeps
    a tie at its boundary whole (a sort would keep one of its entries and drop the other)."""
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1], [0.4, 0.2, 0.2, 0.1, 0.1]]))
    params = RowParams(temperature=torch.ones(2), top_k=torch.tensor([2, 0]), top_p=torch.tensor([1.0, 0.5]))
    probs = filtered_log_probs(logits, params).exp()
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.25, 0.25, 0, 0]]).expand(2, -1))
    torch.testing.assert_close(probs[:1], TopKLogitsWarper(2)(None, logits[:1].clone()).softmax(-1))


def test_repetition_penalty_and_min_p_filter_as_transformers_does():
    """The sampled distribution equals transformers' processors in their order: repetition
    penalty, temperature, top-k, top-p, min-p (each row its own seen tokens)."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    from arctic_fca.engine.sampling import seen_tokens

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    history = [[3, 7, 7, 20], [1, 2], [45, 3, 9, 9, 9, 30]]
    for penalty, temperature, top_k, top_p, min_p in ((1.3, 0.8, 0, 1.0, 0.1), (0.7, 1.2, 10, 0.9, 0.05),
                                                      (2.0, 1.0, 0, 0.95, 0.0)):
        params = RowParams(temperature=torch.full((3,), temperature), top_k=torch.full((3,), top_k),
                           top_p=torch.full((3,), top_p), any_top_k=top_k > 0, any_top_p=top_p < 1, min_p=min_p,
                           repetition_penalty=penalty, seen=seen_tokens(history, 50, torch.device("cpu")))
        ours = filtered_log_probs(logits, params).softmax(-1)
        processors = [RepetitionPenaltyLogitsProcessor(penalty), TemperatureLogitsWarper(temperature)]
        processors += [TopKLogitsWarper(top_k)] if top_k else []
        processors += [TopPLogitsWarper(top_p)] if top_p < 1 else []
        processors += [MinPLogitsWarper(min_p)] if min_p else []
        for row, ids in enumerate(history):
            theirs = LogitsProcessorList(processors)(torch.tensor([ids]), logits[row : row + 1].clone()).softmax(-1)[0]
            torch.testing.assert_close(ours[row], theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("penalty", [1.5, 1e3])  # 1e3: no token may repeat, so each step's own tokens count
def test_greedy_with_a_repetition_penalty_equals_transformers_generate(tokenizer, penalty):
    engine, reference = make_engine(tokenizer)
    prompts = random_prompts((9, 17), len(tokenizer), seed=5)
    params = SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=penalty)
    for out in engine.generate(prompts, params):
        prompt = prompts[out.prompt_index]
        ids = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                                 repetition_penalty=penalty, pad_token_id=0)
        assert out.tokens == ids[0, len(prompt):].tolist()


def test_weight_update_sleep_and_wake(tokenizer):
    engine, _ = make_engine(tokenizer, seed=1)
    other = build_tiny_model(tokenizer, seed=2)
    prompts = random_prompts((14, 30), len(tokenizer))
    params = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    engine.update_weights(other.state_dict().items(), version=7)
    outputs = engine.generate(prompts, params)
    assert {o.policy_version for o in outputs} == {7}
    assert all(o.tokens == hf_greedy(other, prompts[o.prompt_index], 8) for o in outputs)
    engine.sleep()
    assert not engine.cache.keys
    with pytest.raises(RequestError, match="asleep"):
        engine.generate(prompts, params)
    engine.wake()
    assert [o.tokens for o in engine.generate(prompts, params)] == [o.tokens for o in outputs]
    assert_weights_shared(engine)


def assert_weights_shared(engine):
    """The fused decoder holds no second copy: the model's projections are views of its tensors."""
    decoder = engine.runner.decoder
    for layer, fused in zip(engine.model.base_model.layers, decoder.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_proj.weight.data_ptr() == fused.qkv.data_ptr()
        assert attn.v_proj.weight.data_ptr() == fused.qkv[-attn.v_proj.weight.shape[0]:].data_ptr()
        assert mlp.up_proj.weight.data_ptr() == fused.gate_up[mlp.gate_proj.weight.shape[0]:].data_ptr()


FAMILIES = {"qwen3": {}, "qwen2": {}, "llama": {}, "mistral": {"sliding_window": None}}


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_decoder_equals_transformers_modules(tokenizer, family):
    """The engine's own decoder against the same engine running transformers' modules (fp32): the
    same greedy tokens and log-probs, for every family it takes, biases and query/key norms included."""
    model = build_tiny_model(tokenizer, family=family, seed=4, **FAMILIES[family])
    prompts = random_prompts((9, 30, 17), len(tokenizer), seed=3)
    params = SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)
    runs = {}
    for fused in (True, False):
        engine = EmbeddedEngine(copy.deepcopy(model), EngineOptions(kv_cache_tokens=2048, fused_decoder=fused))
        assert (engine.runner.decoder is not None) == fused
        runs[fused] = engine.generate(prompts, params)
    assert [o.tokens for o in runs[True]] == [o.tokens for o in runs[False]]
    for fused_out, plain_out in zip(runs[True], runs[False], strict=True):
        assert torch.allclose(torch.tensor(fused_out.logprobs), torch.tensor(plain_out.logprobs), atol=1e-5)
    out = runs[True][4]
    assert out.tokens == hf_greedy(model, prompts[out.prompt_index], 20)


def test_models_the_fused_decoder_does_not_take_run_on_transformers_modules(tokenizer):
    model = build_tiny_model(tokenizer, seed=5, hidden_act="gelu")
    reference = copy.deepcopy(model)
    engine = EmbeddedEngine(model, EngineOptions(kv_cache_tokens=2048))
    assert engine.runner.decoder is None
    prompts = random_prompts((12,), len(tokenizer))
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True))
    assert all(o.tokens == hf_greedy(reference, prompts[0], 10) for o in out)


def test_bad_requests_and_unsupported_models_get_clear_errors(tokenizer):
    engine, _ = make_engine(tokenizer, max_num_seqs=4, kv_cache_tokens=64)
    with pytest.raises(RequestError, match=(r"n=8 samples of one prompt exceed the 4 sequences the sampler runs "
                                            r"at once \(sampler.max_batch_size")):
        engine.generate([[5, 6]], SamplingParams(n=8))
    with pytest.raises(RequestError,
                       match=r"prompts\[0\] with n=2 and max_tokens=100 needs 16 KV blocks; the cache has 3"):
        engine.generate([[5] * 20], SamplingParams(n=2, max_tokens=100))
    with pytest.raises(RequestError, match=r"prompts\[1\] is empty"):
        engine.generate([[5], []], SamplingParams())
    with pytest.raises(RequestError, match=r"prompts\[0\] contain token id 99999 >= vocab size"):
        engine.generate([[5, 99999]], SamplingParams())
    with pytest.raises(RequestError, match=r"stop_token_ids \[99999\] are >= the vocabulary size \d+: no sample"):
        engine.generate([[5, 6]], SamplingParams(stop_token_ids=[7, 99999]))
    with pytest.raises(ConfigError, match="temperature: Input should be greater than or equal to 0"):
        validate(SamplingParams, {"temperature": -1})
    with pytest.raises(ConfigError, match="block_size"):
        validate(EngineOptions, {"block_size": "big"})
    with pytest.raises(ConfigError, match="block_size must be a power of two >= 16, got 24"):
        validate(EngineOptions, {"block_size": 24})  # refused with the config, not at the first decode step
    with pytest.raises(ConfigError, match="kv_cache_tokens=8 holds no block of 16 tokens"):
        validate(EngineOptions, {"kv_cache_tokens": 8})
    with pytest.raises(ConfigError, match="max_model_len=100000 exceeds the model's max_position_embeddings=512"):
        make_engine(tokenizer, max_model_len=100_000)
    with pytest.raises(ConfigError, match="sliding-window"):
        EmbeddedEngine(build_tiny_model(tokenizer, family="mistral"))
    assert engine.generate([[5, 6]], SamplingParams(max_tokens=2))  # still serving


@pytest.mark.parametrize("failing", ["decode", "second prefill chunk"])
def test_a_failing_call_gives_every_block_back(tokenizer, monkeypatch, failing):
    # Chunks of 16 tokens: when the second one fails, the prompts' blocks are indexed but not all computed.
    engine, reference = make_engine(tokenizer, chunked_prefill=True, max_prefill_tokens=16)
    prompts = random_prompts((20, 33), len(tokenizer))
    params = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    prefill, calls = engine.runner.prefill, []

    def dies(*args, **kwargs):
        calls.append(1)
        if failing == "second prefill chunk" and len(calls) == 1:
            return prefill(*args, **kwargs)
        raise RuntimeError(f"device fell over in the {failing}")

    if failing == "decode":
        monkeypatch.setattr(engine, "_decode", dies)
    else:
        monkeypatch.setattr(engine.runner, "prefill", dies)
    with pytest.raises(RuntimeError, match=failing):
        engine.generate(prompts, params)
    monkeypatch.undo()
    assert engine.pool.num_free == engine.pool.capacity
    assert all(o.tokens == hf_greedy(reference, prompts[o.prompt_index], 8) for o in engine.generate(prompts, params))


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    (((65, 8), (4, 8)), {}, r"x \[<= 64, K\]"),
    (((2, 8), (4, 6)), {}, r"weight \[N, K\]"),
    (((2, 8), (5, 8)), {"gated": True}, "gate over up"),
    (((2, 8), (4, 8)), {"residual": (2, 3)}, r"residual \(2, 3\) for output \(2, 4\)"),
    (((2, 8), (4, 8)), {"next_norm": (4,)}, "next_norm .* needs a residual"),
])
def test_fused_linear_names_what_it_cannot_take(args, kwargs, message):
    from arctic_fca.engine.fused_linear import fused_linear

    x, weight = (torch.zeros(shape) for shape in args)
    tensors = {key: torch.zeros(value) if isinstance(value, tuple) else value for key, value in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        fused_linear(x, weight, **tensors)


@pytest.mark.slow
def test_triton_kernels_and_engine_under_the_interpreter():
    """The GPU kernels' own code, run by Triton's CPU interpreter against the exact torch path."""
    script = Path(__file__).with_name("triton_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cases"] == 134 and result["max_abs_diff"] < 1e-5 and result["engine_greedy_matches"]
    assert result["plain_kernel_equals_torch_build"]
    sampling = result["sampling"]
    assert (sampling["logprob_max_abs_diff"] < 1e-5 and sampling["greedy_is_argmax"]
            and sampling["same_seed_same_tokens"])
    assert sampling["chi_square"] < 31.3 and sampling["dominant_token_wins"], sampling
    assert sampling["row_seeds_chi_square"] < 31.3 and sampling["row_seeds_same_alone_as_in_batches"], sampling
    assert sampling["row_seeds_distinct_tokens"] >= 6, sampling
    assert sampling["filters_keep_what_the_sort_keeps"] and sampling["filtered_logprob_max_abs_diff"] < 1e-5, sampling
    assert sampling["row_min_p_floors_as_shared_min_p"], sampling
    assert sampling["filtered_draws_outside"] == 0 and sampling["filtered_chi_square"] < 10.8, sampling

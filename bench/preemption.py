"""How a KV cache too small for a rollout is shared: preemptions, recompute passes, decode steps.

A GRPO rollout scaled down to run on the CPU in seconds (64 prompts of 256 tokens, 8 samples each,
up to 256 new tokens, stop ids that end most samples within ~60 tokens, as RL rollouts do; a tiny
random Qwen3), on the embedded engine with blocks lent on demand, in caches of several sizes and
with several sampling seeds. Per cache size, the mean over seeds of: preemptions (and how many
distinct samples they hit, and the most times one sample was preempted), prefill passes and the
prompt tokens they ran (a preempted sample's recompute included), decode steps, and the most
samples decoded at once. **Baseline**, same run: the same rollouts in a cache that holds them all.
Counts, not times: what each costs depends on the GPU (a prefill pass interrupts decoding).

    uv run python bench/preemption.py [--blocks 600 830 1200 2000] [--seeds 5]

The last line printed is a JSON object of all results.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from arctic_core.config import SamplingParams
from arctic_fca.engine import EmbeddedEngine, EngineOptions
from arctic_fca.engine.scheduler import Scheduler

PROMPTS, SAMPLES, PROMPT_LEN, MAX_TOKENS, VOCAB = 64, 8, 256, 256, 4096
STOP_IDS = list(range(3, 71))  # 68 of 4,096 ids: a sample stops after ~60 tokens on average
ROOMY_BLOCKS = 20_000


def tiny_model() -> torch.nn.Module:
    config = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class PreemptionLog:
    """Counts each sample's preemptions (wrapping the scheduler's ``preempt``)."""

    def __init__(self) -> None:
        self.times: collections.Counter[int] = collections.Counter()
        preempt = Scheduler.preempt

        def counted(scheduler, running, steps):
            kept, groups = preempt(scheduler, running, steps)
            self.times.update(id(group.resumes) for group in groups)
            return kept, groups

        Scheduler.preempt = counted


def rollout(model, blocks: int, seed: int, log: PreemptionLog) -> dict[str, float]:
    log.times.clear()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, VOCAB, (PROMPT_LEN,), generator=generator).tolist() for _ in range(PROMPTS)]
    engine = EmbeddedEngine(model, EngineOptions(kv_cache_tokens=blocks * 16, max_num_seqs=PROMPTS * SAMPLES))
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=STOP_IDS, seed=seed)
    outputs = engine.generate(prompts, params)
    stats = engine.stats
    return {"preempted": stats.preempted, "samples_preempted": len(log.times),
            "most_times_one_sample": max(log.times.values(), default=0), "prefill_passes": stats.prefill_steps,
            "prefill_tokens": stats.prefill_tokens, "decode_steps": stats.decode_steps,
            "most_running": stats.most_running, "mean_new_tokens": sum(len(o.tokens) for o in outputs) / len(outputs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[600, 830, 1200, 2000],
                        help="KV cache sizes in blocks of 16 tokens (the rollout needs 9,216 at worst)")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    model, log = tiny_model(), PreemptionLog()
    results = {}
    for blocks in [*args.blocks, ROOMY_BLOCKS]:
        runs = [rollout(model, blocks, seed, log) for seed in range(1, args.seeds + 1)]
        results[blocks] = {key: round(statistics.mean(run[key] for run in runs), 1) for key in runs[0]}
        print(f"{blocks:>6} blocks: " + ", ".join(f"{k} {v}" for k, v in results[blocks].items()), flush=True)
    print(json.dumps({"baseline_blocks": ROOMY_BLOCKS, "results": results}))


if __name__ == "__main__":
    main()

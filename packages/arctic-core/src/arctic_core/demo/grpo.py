"""The demo's GRPO loop: the "framework" side, talking to the backend only through the client.

Rewards and group-normalised advantages are computed here on the CPU, as an RL framework would;
generation, log-probs, loss, backward, optimizer step and weight sync run behind the client. With
``ahead`` > 0 (``arctic-rl demo --async K``) rollouts run K steps ahead of training
(:func:`arctic_core.run_ahead.run_ahead`).
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient
from arctic_core.config import ArcticConfig, LogProbConfig, ModelConfig, OptimizerConfig, SamplingParams, TrainerConfig
from arctic_core.demo.metrics import MetricsLogger, plot_rewards
from arctic_core.demo.task import CountingTask, Problem, is_well_formed
from arctic_core.demo.tiny_model import save_tiny_policy
from arctic_core.errors import ConfigError
from arctic_core.checkpoint_files import HF_EXPORT
from arctic_core.run_ahead import run_ahead


@dataclass
class DemoSettings:
    steps: int = 400
    seed: int = 0
    prompts_per_step: int = 16
    samples_per_prompt: int = 16
    warmup_steps: int = 30
    sft_lr: float = 3e-3
    lr: float = 5e-4
    kl_coef: float = 1e-3
    temperature: float = 1.0
    ops: tuple[str, ...] = ("repeat", "up", "down")
    ahead: int = 0  # rollouts run this many steps ahead of training (0: synchronous)


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, problem: Problem) -> list[int]:
    messages = [{"role": "user", "content": problem.prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def group_advantages(rewards: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's std (+eps)."""
    adv = torch.zeros_like(rewards)
    for rows in batch.groups():
        r = rewards[rows]
        adv[rows] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    return adv


@dataclass
class Rollout:
    batch: RolloutBatch
    texts: list[str]
    rewards: torch.Tensor
    gen_metrics: dict[str, float]


class GRPODemo:
    def __init__(self, out: Path, settings: DemoSettings) -> None:
        self.out, self.s = out, settings
        self.task = CountingTask(ops=settings.ops)
        self.rng = random.Random(settings.seed)
        self.policy_dir = save_tiny_policy(out / "policy", self.task.corpus(), seed=settings.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(self.policy_dir)
        self.eos = self.tokenizer.eos_token_id
        self.metrics = MetricsLogger(out / "tensorboard")
        self.client: ArcticClient | None = None
        self._drawn: list[list[Problem]] = []  # each step's problems, in step order
        self._drawing = threading.Lock()

    def _client(self, policy: Path, lr: float, reference: bool) -> ArcticClient:
        return ArcticClient.in_process(
            ArcticConfig(
                model=ModelConfig(path=str(policy), device="cpu"),
                trainer=TrainerConfig(optimizer=OptimizerConfig(lr=lr, max_grad_norm=1.0)),
                reference=LogProbConfig() if reference else None,
                seed=self.s.seed,
            )
        )

    # ----------------------------------------------------------------- phases
    def warm_up(self) -> None:
        """A short SFT on task demonstrations, stopped long before the task is learned.

        After the default 30 steps the policy mostly writes the answer format but its answers are
        still wrong (reward ~0.1 when sampled): GRPO does the learning from there. Without any warm-up
        a random 300-token policy almost never writes digits, and SFT on random well-formed answers
        teaches it to ignore the prompt, which a tiny model does not unlearn by RL in minutes. The
        SFT result becomes both the GRPO policy and its frozen KL reference (the usual SFT -> RL).
        """
        policy = self.policy_dir
        if self.s.warmup_steps:
            with self._client(policy, self.s.sft_lr, reference=False) as sft:
                for step in tqdm(range(self.s.warmup_steps), desc="SFT warm-up", unit="step", dynamic_ncols=True):
                    problems = self.task.sample(self.rng, self.s.prompts_per_step)
                    prompts = [chat_prompt_ids(self.tokenizer, p) for p in problems]
                    answers = [self._encode_answer(self.task.answer(p)) for p in problems]
                    batch = RolloutBatch.from_lists(prompts, answers, list(range(len(prompts))))
                    metrics = sft.fwd_bwd(batch, "sft").metrics
                    sft.step()
                    self.metrics.log("warmup", metrics, step)
                sft.save_checkpoint(str(self.out / "sft"), export_hf=True)
            policy = self.out / "sft" / HF_EXPORT
        self.client = self._client(policy, self.s.lr, reference=True)

    def grpo_step(self, step: int) -> dict[str, float]:
        return self.train(step, self.rollout(step))

    def rollout(self, step: int) -> Rollout:
        """Step ``step``'s samples and rewards (in a thread of its own when rollouts run ahead)."""
        assert self.client is not None, "warm_up() builds the GRPO client"
        problems = self._problems(step)
        params = SamplingParams(
            n=self.s.samples_per_prompt, temperature=self.s.temperature, max_tokens=2 * self.task.length + 4,
            stop_token_ids=[self.eos], seed=self.s.seed * 100_003 + step,
        )
        gen = self.client.generate([chat_prompt_ids(self.tokenizer, p) for p in problems], params)
        batch = gen.batch
        texts = [self.tokenizer.decode(batch.response(i), skip_special_tokens=True) for i in range(batch.num_responses)]
        rewards = torch.tensor([self.task.reward(problems[int(p)], t)
                                for p, t in zip(batch.prompt_index, texts, strict=True)])
        return Rollout(batch, texts, rewards, gen.metrics)

    def _problems(self, step: int) -> list[Problem]:
        """Each step's problems, drawn in step order from the run's generator whatever order the
        rollouts in flight ask in."""
        with self._drawing:
            while len(self._drawn) <= step:
                self._drawn.append(self.task.sample(self.rng, self.s.prompts_per_step))
            return self._drawn[step]

    def train(self, step: int, rollout: Rollout) -> dict[str, float]:
        """One update on ``rollout``: the old log-probs are the trainer's now; samples drawn by an
        older policy (rollouts ahead) are weighed by the trainer's over the sampler's probabilities
        (truncated importance sampling), and none older than ``ahead`` syncs is trained on."""
        assert self.client is not None, "warm_up() builds the GRPO client"
        batch, rewards, texts = rollout.batch, rollout.rewards, rollout.texts
        old = self.client.log_probs(batch, temperature=self.s.temperature).outputs["logprobs"]
        ref = self.client.log_probs(batch, model="reference", temperature=self.s.temperature).outputs["logprobs"]
        batch = batch.replace(old_logprobs=old, ref_logprobs=ref, rewards=rewards,
                              advantages=group_advantages(rewards, batch))
        ppo = {"name": "ppo", "clip_low": 0.2, "clip_high": 0.28}
        if self.s.ahead:
            ppo["sampler_correction"] = {"mode": "token-truncate", "high": 2.0}
        loss = [ppo, {"name": "kl", "weight": self.s.kl_coef}]
        train = self.client.fwd_bwd(batch, loss, temperature=self.s.temperature,
                                    max_staleness=self.s.ahead if self.s.ahead else None).metrics
        opt = self.client.step().metrics
        self.client.sync_weights()
        return {
            "reward": float(rewards.mean()),
            "format_rate": sum(is_well_formed(t, self.task.length) for t in texts) / len(texts),
            "generate_tok_per_s": rollout.gen_metrics["generated_tokens"] / max(rollout.gen_metrics["seconds"], 1e-9),
            "sampler_vs_trainer_logprob_gap": float((batch.sampling_logprobs - old).abs().max()),
            **{f"train/{k}": v for k, v in train.items()},
            **{f"opt/{k}": v for k, v in opt.items()},
        }

    def run(self) -> dict[str, object]:
        start = time.perf_counter()
        self.warm_up()
        rewards: list[float] = []
        bar = tqdm(total=self.s.steps, desc="GRPO", unit="step", dynamic_ncols=True)
        for step, metrics in enumerate(run_ahead(self.s.steps, self.rollout, self.train, self.s.ahead)):
            bar.update()
            rewards.append(metrics["reward"])
            self.metrics.log("grpo", metrics, step)
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", gen_tok_s=f"{metrics['generate_tok_per_s']:.0f}")
        bar.close()
        self.client.save_checkpoint(str(self.out / "checkpoint"), export_hf=True)
        plot_rewards(rewards, self.out / "reward_curve.png")
        self.metrics.close()
        self.client.shutdown()
        window = max(1, min(5, len(rewards) // 5))
        summary = {
            "initial_reward": sum(rewards[:window]) / window,
            "final_reward": sum(rewards[-window:]) / window,
            "steps": len(rewards),
            "seconds": round(time.perf_counter() - start, 2),
            "reward_window": window,
            "out": str(self.out),
            "settings": asdict(self.s),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _encode_answer(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) + [self.eos]


# What a run writes into its folder: an earlier run's are replaced by the next run there.
DEMO_OUTPUTS = {"policy", "sft", "tensorboard", "checkpoint", "reward_curve.png", "summary.json"}


def run_demo(out: Path, settings: DemoSettings) -> dict[str, object]:
    clear_earlier_run(out)
    out.mkdir(parents=True, exist_ok=True)
    return GRPODemo(out, settings).run()


def clear_earlier_run(out: Path, outputs: set[str] = DEMO_OUTPUTS, owner: str = "demo") -> None:
    """Make ``out`` ready for a run: new, empty, or an earlier run's folder (its ``outputs``
    removed, so that its TensorBoard curves do not mix with this run's). A folder holding anything
    else is refused, never written into."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"the {owner}'s folder {out} is a file")
    entries = list(out.iterdir()) if out.is_dir() else []
    others = sorted(entry.name for entry in entries if entry.name not in outputs)
    if others:
        raise ConfigError(f"the {owner}'s folder {out} holds {others[:3]}, which no {owner} run wrote: choose a new "
                          "or empty folder (an earlier run's folder is reused)")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:  # a file, or a link (to a folder too: the link goes, never what it points to)
            entry.unlink()


def warmed_up_policy(out: Path, ops: tuple[str, ...], steps: int = 20) -> Path:
    """The demo's SFT warm-up alone: a Hugging Face folder whose policy writes the answer format but
    still answers wrongly (reward ~0.1 when sampled), where a framework's own GRPO on the task starts."""
    demo = GRPODemo(out, DemoSettings(seed=0, ops=ops, warmup_steps=steps))
    demo.warm_up()
    demo.client.close()
    return out / "sft" / HF_EXPORT

"""verl's PPO trainer with Arctic as its engine: ``trainer.v1.trainer_mode=arctic``.

verl keeps its loop: data, the agent loop and rewards, advantage estimators, metrics,
validation, the checkpoint schedule. Where verl would call its GPU worker groups, this trainer
calls the Arctic client instead: ``log_probs`` for the old and reference log-probs,
``fwd_bwd`` + ``step`` per PPO mini-batch, ``sync_weights`` after each step, and Arctic's
samplers behind verl's LLM client (:mod:`arctic_verl.rollout`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.experimental.reward_loop import RewardLoopManager
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import agg_loss
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
from verl.utils import tensordict_utils as tu
from verl.utils.debug import marked_timer
from verl.utils.debug.metrics import calculate_debug_metrics
from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
from verl.workers.config import FSDPOptimizerConfig
from verl.workers.utils.padding import response_to_nested

from arctic_core.adapters.export import link_export
from arctic_core.adapters.mapping import check_supported
from arctic_core.adapters.metrics import framework_metrics, mean_over_calls, prefixed
from arctic_core.adapters.schedule import StandInSchedule
from arctic_core.client import ArcticClient
from arctic_verl.backend import open_backend, server_gpus
from arctic_verl.data import to_rollout_batch
from arctic_verl.mapping import MAPPING, actor_optim, get
from arctic_verl.rollout import ArcticLLMClient
from arctic_verl.settings import read_settings

log = logging.getLogger(__name__)
MODE = "arctic"
POLL_INTERVAL_S = 0.05


class ArcticActor:
    """Stands where verl's actor worker group stands for the checkpoint and batch-balancing code
    the trainer inherits: saves and loads go to Arctic, and it reports one data-parallel rank
    (Arctic splits the work over its own devices)."""

    _dispatch_info = {"actor": [0]}  # verl's balancer reads the actor's data-parallel ranks here

    def __init__(self, arctic: ArcticClient, export_hf: bool = False) -> None:
        self.arctic, self.export_hf = arctic, export_hf
        self.saved: list[str] = []

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None) -> None:
        self.arctic.save_checkpoint(local_path, export_hf=self.export_hf)
        if self.export_hf:  # where verl writes its Hugging Face copy (save_contents: hf_model)
            link_export(local_path, Path(local_path) / "huggingface")
        self.saved.append(local_path)
        while max_ckpt_to_keep and len(self.saved) > max_ckpt_to_keep:  # as verl's checkpoint managers do
            shutil.rmtree(self.saved.pop(0), ignore_errors=True)

    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False) -> None:
        self.arctic.load_checkpoint(local_path)


def read_rows(batch: KVBatchMeta, fields: list[str]) -> TensorDict:
    """The batch's rows from verl's TransferQueue, with ``fields`` only."""
    return tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)


def write_rows(batch: KVBatchMeta, **fields: torch.Tensor) -> None:
    """Store per-row ``fields`` (jagged tensors in row order) for the batch in verl's TransferQueue."""
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict(fields, batch_size=len(batch)))


def learning_rates(optim: FSDPOptimizerConfig) -> StandInSchedule:
    """verl's learning rate after ``n`` scheduler steps: its schedule functions, chosen and set up
    as verl's engines do (verl steps the schedule once per training step)."""
    total, warmup = optim.total_training_steps, optim.lr_warmup_steps
    if warmup <= 0:
        warmup = int(optim.lr_warmup_steps_ratio * total)
    if optim.lr_scheduler_type == "cosine":
        return StandInSchedule(optim.lr, lambda stand_in: get_cosine_schedule_with_warmup(
            stand_in, num_warmup_steps=warmup, num_training_steps=total, min_lr_ratio=optim.min_lr_ratio,
            num_cycles=optim.num_cycles, zero_indexed_step=optim.zero_indexed_step))
    return StandInSchedule(optim.lr, lambda stand_in: get_constant_schedule_with_warmup(
        stand_in, num_warmup_steps=warmup))


def actor_metrics(train: list[dict[str, float]], steps: list[dict[str, float]], policy: str,
                  lr: float) -> dict[str, float]:
    """verl's actor metric names where Arctic computes the same quantity, and every Arctic metric
    under ``arctic/``, each the mean over the step's mini-batches (extremes: the extreme), as verl
    reduces them."""
    means = {**prefixed(mean_over_calls(train), "train/"), **prefixed(mean_over_calls(steps), "step/")}
    return {**prefixed(means), **framework_metrics(means, MAPPING.metric_names, policy), "actor/lr": lr}


@register_trainer(MODE)
class ArcticTrainer(PPOTrainer):
    """verl's synchronous PPO trainer (sample, then train, then sync) on the Arctic backend."""

    def _build_replay_buffer(self):
        # Sampling and training alternate: verl's synchronous schedule and replay buffer.
        self.trainer_mode = "sync"
        buffer = super()._build_replay_buffer()
        # verl's buffer checks for finished samples every 2 s, longer than a whole small step here.
        buffer.poll_interval = min(buffer.poll_interval, POLL_INTERVAL_S)
        return buffer

    def _setup(self) -> None:
        self.settings = read_settings(self.config)
        check_supported(MAPPING, self.config, self.settings)
        actor = self.config.actor_rollout_ref.actor
        self.loss = MAPPING.loss_terms(self.config)
        self.temperature = float(self.config.actor_rollout_ref.rollout.temperature)
        self.max_response_len = actor.loss_scale_factor  # verl's constant for seq-mean-token-sum-norm
        self._init_tokenizer()
        self._init_dataloader()
        self._init_dump_executor()
        self.learning_rate = learning_rates(actor_optim(self.config))  # after _init_dataloader: it sets the horizon
        self.arctic, self.address = open_backend(self.config, self.settings)
        saved = get(self.config, "actor_rollout_ref.actor.checkpoint.save_contents") or ()
        self.actor_rollout_wg = ArcticActor(self.arctic, export_hf="hf_model" in saved)
        self.reward_loop_manager = RewardLoopManager(config=self.config, rm_resource_pool=None)
        self.teacher_model_manager = self.distillation_config = None
        self._load_checkpoint()

    # ------------------------------------------------------------------ hooks
    def on_init_end(self) -> None:
        """The samplers serve the trainer's (possibly restored) weights before the first sample;
        the rollout client reports each sample's weights as verl's step number."""
        version = self.arctic.sync_weights().policy_version
        self.step_offset = version - self.global_steps

    def on_sample_end(self) -> None:
        """Nothing to free: with ``colocate`` Arctic itself sleeps the engines a call does not use."""

    def on_step_end(self) -> None:
        with marked_timer("update_weights", self.timing_raw, color="red"):
            result = self.arctic.sync_weights()
        self._pending_sync_metrics = {"arctic/policy_version": float(result.policy_version),
                                      **{f"arctic/sync/{k}": v for k, v in result.metrics.items()}}

    def get_llm_client(self) -> ArcticLLMClient:
        return ArcticLLMClient(self.config, self.address, self.step_offset, self.settings)

    def _get_n_gpus_for_throughput(self) -> int:
        return max(1, int(server_gpus(self.settings)))

    # ------------------------------------------------------------------ the step
    def _compute_old_log_prob(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        rollout_correction = self.config.algorithm.get("rollout_correction", None)
        if rollout_correction and rollout_correction.get("bypass_mode", False):
            return super()._compute_old_log_prob(batch, metrics)  # the sampler's log-probs serve: no forward
        with_rollout = bool(self.config.actor_rollout_ref.rollout.calculate_log_probs)
        fields = ["prompts", "responses", "response_mask"] + (["rollout_log_probs"] if with_rollout else [])
        data = read_rows(batch, fields)
        outputs = self.arctic.log_probs(to_rollout_batch(data), processors=("logprobs", "entropy"),
                                        temperature=self.temperature).outputs
        mask = data["response_mask"]
        write_rows(batch, old_log_probs=response_to_nested(outputs["logprobs"], mask),
                   entropy=response_to_nested(outputs["entropy"], mask))
        actor = self.config.actor_rollout_ref.actor
        padded_mask = mask.to_padded_tensor(0)
        entropy = agg_loss(loss_mat=outputs["entropy"], loss_mask=padded_mask, loss_agg_mode=actor.loss_agg_mode,
                           loss_scale_factor=actor.loss_scale_factor)
        metrics["actor/entropy"] = entropy.item()
        if with_rollout:
            padded = {"old_log_probs": outputs["logprobs"], "response_mask": padded_mask,
                      "rollout_log_probs": data["rollout_log_probs"].to_padded_tensor(0.0),
                      "responses": data["responses"].to_padded_tensor(0)}
            metrics.update(calculate_debug_metrics(DataProto(batch=TensorDict(padded, batch_size=len(batch)))))
        return batch

    def _compute_ref_log_prob(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        data = read_rows(batch, ["prompts", "responses", "response_mask"])
        outputs = self.arctic.log_probs(to_rollout_batch(data), model="reference", temperature=self.temperature).outputs
        write_rows(batch, ref_log_prob=response_to_nested(outputs["logprobs"], data["response_mask"]))
        return batch

    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's PPO update: its mini-batches (size, epochs, shuffle, seed), one ``fwd_bwd`` and one
        optimizer ``step`` each, at verl's learning rate for this training step."""
        actor = self.config.actor_rollout_ref.actor
        fields = ["prompts", "responses", "response_mask", "old_log_probs", "advantages"]
        fields += ["ref_log_prob"] if actor.use_kl_loss else []
        fields += ["rollout_log_probs"] if self.loss[0]["sampler_correction"] else []
        rollout = to_rollout_batch(read_rows(batch, fields))
        lr = self.learning_rate(self.global_steps - 1)  # verl's schedule has stepped once per earlier step
        train, steps = [], []
        for rows in self._mini_batches(rollout.num_responses):
            result = self.arctic.fwd_bwd(rollout.select(rows), self.loss, temperature=self.temperature,
                                         max_response_len=self.max_response_len)
            train.append(result.metrics)
            steps.append(self.arctic.step(lr=lr).metrics)
        # verl logs the rate its schedule holds after this step's update (it steps, then reads it).
        metrics.update(actor_metrics(train, steps, self.loss[0]["name"], self.learning_rate(self.global_steps)))
        return batch

    def _mini_batches(self, num_rows: int) -> list[torch.Tensor]:
        """The rows of each PPO mini-batch, from verl's own iterator as one rank runs it."""
        actor = self.config.actor_rollout_ref.actor
        index = TensorDict({"row": torch.arange(num_rows)}, batch_size=[num_rows])
        iterator = tu.make_iterator(index,
                                    mini_batch_size=actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n,
                                    epochs=actor.ppo_epochs, seed=actor.data_loader_seed,
                                    dataloader_kwargs={"shuffle": actor.shuffle})
        return [mini_batch["row"] for mini_batch in iterator]

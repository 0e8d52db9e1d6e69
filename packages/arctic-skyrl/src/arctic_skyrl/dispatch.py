"""What SkyRL's trainer calls on its worker dispatch, done by the Arctic client.

SkyRL's ``RayPPOTrainer.train()`` drives its Ray worker groups through one ``WorkerDispatch``
object (``self.dispatch``). :class:`ArcticDispatch` stands in its place with the same methods:
forwards and training steps become Arctic ``log_probs`` / ``fwd_bwd`` / ``step`` calls, the weight
push ``sync_weights``, checkpoints Arctic's own. Only the ``policy`` and ``ref`` models exist (a
critic is refused at start-up); one data-parallel rank is reported, as Arctic splits the work over
its own devices. Every method ``train()`` calls is implemented; a contract test lists them from
SkyRL's source, so a SkyRL release that adds one fails the tests rather than a user's run.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.config import SkyRLTrainConfig
from transformers import get_scheduler

from arctic_core.adapters.export import export_model
from arctic_core.adapters.metrics import framework_metrics, prefixed
from arctic_core.adapters.schedule import StandInSchedule
from arctic_core.client import ArcticClient
from arctic_skyrl.data import right_aligned, to_rollout_batch
from arctic_skyrl.mapping import MAPPING

MODELS = ("policy", "ref")


class ArcticDispatch:
    """SkyRL's ``WorkerDispatch`` interface over one Arctic backend."""

    def __init__(self, cfg: SkyRLTrainConfig, arctic: ArcticClient, num_training_steps: int) -> None:
        self.cfg, self.arctic = cfg, arctic
        algorithm = cfg.trainer.algorithm
        self.temperature = float(algorithm.temperature)
        self.loss = MAPPING.loss_terms(cfg)
        self.policy_name = self.loss[0]["name"]
        self.schedule = learning_rates(cfg, num_training_steps)
        self.optimizer_steps = 0
        self.last_sync_seconds: float | None = None

    # ------------------------------------------------------------------ forwards
    def forward(self, model: str, data: TrainingInputBatch, loss_fn: str | None = None,
                loss_fn_config: dict[str, Any] | None = None, **worker_kwargs: Any) -> WorkerOutput:
        """Per-row log-probs (``policy`` or ``ref``), right-aligned over the response window."""
        if loss_fn is not None:
            raise ValueError(f"arctic-skyrl: forward with loss_fn={loss_fn!r} (the Tinker API) is not supported")
        logprobs = self.log_probs(data, (model,))[model]
        return WorkerOutput(loss_fn_outputs=[{"logprobs": row.tolist()} for row in logprobs])

    def log_probs(self, data: TrainingInputBatch, models: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``[rows, response_length]`` log-probs of each of ``models`` (``policy``, ``ref``) in
        SkyRL's right-aligned layout, from one conversion of the rows."""
        batch = to_rollout_batch(data, with_fields=False)
        width = int(data.metadata["response_length"])
        out = {}
        for model in models:
            self._check_model(model)
            outputs = self.arctic.log_probs(batch, model="reference" if model == "ref" else "policy",
                                            temperature=self.temperature).outputs
            out[model] = right_aligned(outputs["logprobs"].float(), batch.response_lens, width)
        return out

    def stage_data(self, model: str, data: TrainingInputBatch,
                   mini_batch_boundaries: list[tuple[int, int]]) -> list[list[TrainingInputBatch]]:
        """Each mini-batch as the chunk of the one data-parallel rank (nothing to serialise: the
        backend is reached through the client)."""
        return [[data[start:end]] for start, end in mini_batch_boundaries]

    def forward_from_staged(self, model: str, chunk_refs: list[TrainingInputBatch], **kwargs: Any) -> WorkerOutput:
        return self.forward(model, _one_chunk(chunk_refs), **kwargs)

    # ------------------------------------------------------------------ training
    def forward_backward(self, model: str, data: TrainingInputBatch, loss_fn: str | None = None,
                         loss_fn_config: dict[str, Any] | None = None, **worker_kwargs: Any) -> WorkerOutput:
        """SkyRL's policy loss on one mini-batch (advantages already scaled by its loss reduction),
        gradients accumulated in Arctic until :meth:`optim_step`."""
        if model != "policy":
            raise ValueError(f"arctic-skyrl trains the policy only, not {model!r} (a critic is not served)")
        if loss_fn is not None or loss_fn_config:
            raise ValueError("arctic-skyrl: per-call loss_fn / loss_fn_config (the Tinker API) is not supported")
        batch = to_rollout_batch(data)
        metrics = self.arctic.fwd_bwd(batch, self.loss, temperature=self.temperature).metrics
        # What packing only identical prompts once would leave, beside the prefix forest's count.
        metrics["prompt_packed_tokens"] = float(batch.prompt_lens.sum() + batch.response_lens.sum())
        return WorkerOutput(metrics=self._train_metrics(metrics, data))

    def forward_backward_from_staged(self, model: str, chunk_refs: list[TrainingInputBatch],
                                     **kwargs: Any) -> WorkerOutput:
        return self.forward_backward(model, _one_chunk(chunk_refs), **kwargs)

    def _train_metrics(self, metrics: dict[str, float], data: TrainingInputBatch) -> dict[str, float]:
        """SkyRL's worker metric names where Arctic computes the same quantity, every Arctic
        metric under ``arctic/``."""
        return {**framework_metrics(metrics, MAPPING.metric_names, self.policy_name),
                "policy_lr": self.schedule(self.optimizer_steps),
                "response_length": float(data.metadata["response_length"]), **prefixed(metrics)}

    def optim_step(self, model: str, model_id: str | None = None) -> float | None:
        """One optimizer step at SkyRL's scheduled learning rate; the gradient norm before clipping."""
        self._check_trained(model)
        result = self.arctic.step(lr=self.schedule(self.optimizer_steps))
        # A step skipped over a non-finite gradient norm leaves SkyRL's schedule where it was, too.
        self.optimizer_steps += 0 if result.metrics.get("skipped") else 1
        return result.metrics.get("grad_norm")

    def set_lr(self, model: str, learning_rate: float, model_id: str | None = None) -> None:
        self._check_trained(model)
        self.schedule = lambda step: learning_rate

    # ------------------------------------------------------------------ weights
    def init_weight_sync_state(self, inference_engine_client: Any) -> None:
        """Arctic pushes weights to its own samplers: nothing to connect; the backend must answer."""
        self.arctic.status()

    async def save_weights_for_sampler(self, model_id: str | None = None) -> None:
        start = time.perf_counter()
        self.arctic.sync_weights()
        self.last_sync_seconds = time.perf_counter() - start

    def get_timing_metrics(self) -> dict[str, float]:
        if self.last_sync_seconds is None:
            return {}
        return {"sync_weights_only_transfer": self.last_sync_seconds}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, model: str, ckpt_dir: str, tokenizer: Any = None, model_id: str | None = None) -> None:
        self._check_trained(model)
        self.arctic.save_checkpoint(ckpt_dir)

    def load_checkpoint(self, model: str, ckpt_dir: str, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True) -> None:
        """Arctic restores weights, optimizer and step count together; SkyRL's schedule resumes at
        the restored step."""
        self._check_trained(model)
        if not (load_optimizer_states and load_lr_scheduler_states):
            raise ValueError("arctic-skyrl restores weights, optimizer and schedule together")
        self.optimizer_steps = self.arctic.load_checkpoint(ckpt_dir).step

    def save_hf_model(self, model: str, export_dir: str, tokenizer: Any = None) -> None:
        """The policy as a Hugging Face folder (weights, config, tokenizer) at ``export_dir``."""
        self._check_trained(model)
        export_model(self.arctic, export_dir)

    def finalize_pending_saves(self, model: str) -> None:
        """Arctic's saves are complete when the call returns."""

    def init_model(self, model: str, model_path: str, num_training_steps: int | None = None) -> None:
        raise NotImplementedError(f"arctic-skyrl: re-initialising the {model!r} model from {model_path} "
                                  "(trainer.update_ref_every_epoch) is not supported")

    # ------------------------------------------------------------------ placement
    def get_lcm_dp_size(self) -> int:
        return 1

    def dp_size(self, model: str) -> int:
        return 1

    def get_node_ids(self) -> list[str]:
        """No worker nodes: SkyRL's old-checkpoint clean-up then runs only where the trainer runs,
        which is where an in-process backend writes (a remote server keeps its own files)."""
        return []

    def mark_all_offloaded(self) -> None:
        """Arctic keeps track of which engines are resident (``colocate``)."""

    def empty_cache(self, model: str | None = None) -> None:
        """Arctic's engines free their own caches."""

    # ------------------------------------------------------------------ profiling
    def start_profile(self, model: str, config: dict | None = None, raise_on_error: bool = False) -> None:
        raise NotImplementedError("arctic-skyrl: trainer.policy.torch_profiler_config is not supported")

    profile_step = stop_profile = start_profile

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_model(model: str) -> None:
        if model not in MODELS:
            raise ValueError(f"arctic-skyrl serves the models {MODELS}, not {model!r}")

    @staticmethod
    def _check_trained(model: str) -> None:
        if model != "policy":
            raise ValueError(f"arctic-skyrl trains the policy only, not {model!r}")


def _one_chunk(chunk_refs: list[TrainingInputBatch]) -> TrainingInputBatch:
    if len(chunk_refs) != 1:
        raise ValueError(f"arctic-skyrl runs one data-parallel rank, got {len(chunk_refs)} chunks")
    return chunk_refs[0]


def learning_rates(cfg: SkyRLTrainConfig, num_training_steps: int) -> StandInSchedule:
    """SkyRL's learning rate after ``n`` optimizer steps: its schedule (transformers'
    ``get_scheduler``, as its FSDP strategy builds it)."""
    optim = cfg.trainer.policy.optimizer_config
    return StandInSchedule(optim.lr, lambda stand_in: get_scheduler(
        optim.scheduler, stand_in, num_warmup_steps=optim.num_warmup_steps, num_training_steps=num_training_steps))

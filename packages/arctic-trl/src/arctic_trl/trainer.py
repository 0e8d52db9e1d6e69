"""``arctic_trl.GRPOTrainer``: TRL's GRPOTrainer with generation, log-probs, loss, backward and the
optimizer step on the Arctic backend. Swap one import; keep the script.

What stays TRL's: the dataset and its repeat sampler, chat templates, reward functions, advantages,
generation buffering (``steps_per_generation`` / ``num_iterations``), the LR schedule, logging and
callbacks. What moves to Arctic (each at one TRL seam):

- ``_generate_single_turn`` -> ``client.generate`` (n samples per prompt, sampling log-probs);
- ``_get_per_token_logps_and_entropies`` -> ``client.log_probs`` (old-policy and reference);
- ``training_step`` -> ``client.fwd_bwd`` with the loss terms of ``mapping.loss_terms``;
- the optimizer -> :class:`ArcticOptimizer`, whose ``step`` is ``client.step(lr)`` then
  ``client.sync_weights()``: the sampler gets the new weights after every optimizer step.

No full model is built on the client: TRL's Trainer machinery gets :class:`PolicyStub` (the
policy's config, its generation config and one placeholder parameter).
"""

from __future__ import annotations

import copy
import logging
import math
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import trl
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedModel

from arctic_core.adapters.backend import open_backend
from arctic_core.adapters.export import link_export_files
from arctic_core.adapters.mapping import check_supported
from arctic_core.adapters.metrics import framework_metrics
from arctic_core.adapters.settings import BackendSettings
from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient
from arctic_core.model_folders import model_folder
from arctic_trl.mapping import (MAPPING, MicroBatch, TRLRun, arctic_config, loss_terms, policy_loss, regroup_is_exact,
                                sampling_params, truncated_sampling_caveat, vllm_notice)

log = logging.getLogger(__name__)

REFERENCE = "reference"  # stands for TRL's ref_model: log-probs come from Arctic's reference engine
SEEDS_PER_STEP = 1009  # sampling seeds set apart per optimizer step (more than a step's generation calls)


class PolicyStub(PreTrainedModel):
    """The policy as TRL's Trainer sees it: config and generation config, no weights (they live in
    the Arctic backend). Any forward call is a bug in the adapter, and says so."""

    def __init__(self, config, generation_config: GenerationConfig) -> None:
        super().__init__(config)
        self.placeholder = torch.nn.Parameter(torch.zeros(1))  # the optimizer and DDP need one
        self.post_init()
        self.generation_config = generation_config

    @classmethod
    def from_path(cls, path: str) -> PolicyStub:
        config = AutoConfig.from_pretrained(path)
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:
            generation = GenerationConfig.from_model_config(config)
        return cls(config, generation)

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        """The backend checkpoints (``arctic_config`` passes TRL's ``gradient_checkpointing`` on)."""

    activation_checkpointing_enable = gradient_checkpointing_enable  # the name transformers >= 5.2x calls

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the policy runs in the Arctic backend; arctic_trl routed a call to the client-side stub")


ARCTIC_CHECKPOINT = "arctic"  # the backend's checkpoint inside each of TRL's checkpoint folders


class ArcticOptimizer(torch.optim.Optimizer):
    """The optimizer TRL's Trainer steps: it applies the backend's accumulated gradients at the
    learning rate of TRL's schedule, then syncs the sampler's weights."""

    def __init__(self, stub: PolicyStub, client: ArcticClient, lr: float,
                 on_step: Callable[[dict[str, float]], None]) -> None:
        super().__init__([stub.placeholder], {"lr": lr})
        self.client, self.on_step = client, on_step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        metrics = dict(self.client.step(lr=self.param_groups[0]["lr"]).metrics)
        metrics["policy_version"] = float(self.client.sync_weights().policy_version)
        self.on_step(metrics)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the backend; ``step`` already cleared them there."""


class GRPOTrainer(trl.GRPOTrainer):
    """Drop-in for ``trl.GRPOTrainer``. ``model`` is a local model folder, a Hub model id (fetched
    into the Hub's cache) or a loaded model (saved to a temporary folder for the backend).
    ``arctic``: an ``ArcticClient``, an ``http://`` URL of ``arctic-rl serve``, or a dict of
    ArcticConfig overrides for the in-process backend (default: DeepSpeed + ZoRRo trainer and the
    embedded FCA sampler on this machine).
    ``use_vllm=True`` keeps Arctic's sampler (``mapping.VLLM_SETTINGS``)."""

    def __init__(self, model: str | PreTrainedModel, reward_funcs: Any, args: trl.GRPOConfig | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 reward_processing_classes: Any = None, callbacks: Any = None, optimizers: Any = (None, None),
                 peft_config: Any = None, *, arctic: ArcticClient | str | dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        args = copy.copy(args) if args is not None else trl.GRPOConfig(output_dir="arctic-grpo")
        path = _model_folder(model)
        settings = backend_settings(arctic)
        check_supported(MAPPING, TRLRun(args, path, settings.config, peft_config, optimizers), settings)
        caveat = truncated_sampling_caveat(args)
        if caveat:
            warnings.warn(caveat, stacklevel=2)
        notice = vllm_notice(args, (arctic or {}) if isinstance(arctic, dict | None) else None)
        if notice:
            log.warning(notice)
        self.arctic = arctic if isinstance(arctic, ArcticClient) else \
            open_backend(settings, lambda: arctic_config(path, args, settings.config))[0]
        beta = args.beta
        # TRL must not build a reference model, clip the placeholder or start vLLM: the backend does
        # each (it was configured with these values above).
        args.beta, args.gradient_checkpointing, args.max_grad_norm, args.use_vllm = 0.0, False, 0.0, False
        stub = PolicyStub.from_path(path)
        self._step_metrics: dict[str, float] = {}
        self._policy_loss = 0.0  # TRL's policy_loss metric of the last micro-batch (with an entropy bonus)
        optimizer = ArcticOptimizer(stub, self.arctic, args.learning_rate, self._record_step)
        super().__init__(model=stub, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset,
                         processing_class=processing_class or AutoTokenizer.from_pretrained(path),
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                         optimizers=(optimizer, None), **kwargs)
        self.beta = args.beta = beta
        self.ref_model = REFERENCE if beta != 0.0 else None
        self._seed_step, self._seed_calls = -1, 0  # see _sampling_seed
        self._on_host: list[dict[str, Any]] | None = None
        # transformers' NaN/inf loss filter, applied in training_step from the host's loss value:
        # the Trainer's own check reads the returned device tensor, which waits for the backward.
        self._filter_nan_inf, self.args.logging_nan_inf_filter = self.args.logging_nan_inf_filter, False

    # ---- generation -----------------------------------------------------------------------------

    def _tokenize_prompts(self, prompts: list):
        """TRL's, once per run of identical prompts: TRL's sampler repeats each prompt
        ``num_generations`` times in a row, and tokenizing every copy of a long prompt costs a visible
        share of a GPU step with one tokenizer thread. Per-row environments, images and processor fields
        keep TRL's own per-row call."""
        runs = _runs(prompts)
        if len(runs) == len(prompts) or getattr(self, "environment_factories", None) is not None:
            return super()._tokenize_prompts(prompts)
        ids, images, fields = super()._tokenize_prompts([prompt for prompt, _ in runs])
        if images is not None or fields:
            return super()._tokenize_prompts(prompts)
        return [list(row) for row, (_, count) in zip(ids, runs, strict=True) for _ in range(count)], None, {}

    def _sampling_seed(self) -> int:
        """A seed per generation call, distinct across the run and the same when a run resumes from a
        checkpoint: from the optimizer step the call serves (restored on resume) and the call's
        index within that step."""
        step = self.state.global_step
        if step != self._seed_step:
            self._seed_step, self._seed_calls = step, 0
        self._seed_calls += 1
        return self.args.seed + SEEDS_PER_STEP * step + self._seed_calls - 1

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None and any(image is not None for image in images):
            raise NotImplementedError("arctic_trl samples text only; images are not supported")
        runs = _runs([list(p) for p in prompt_ids])  # TRL's sampler repeats each prompt num_generations times in a row
        params = {**sampling_params(self.args, self.temperature), "max_tokens": self.max_completion_length,
                  "stop_token_ids": list(self.eos_token_ids), "seed": self._sampling_seed()}
        sizes = {n for _, n in runs}
        # One call when every prompt has the same sample count (always, in training); else per prompt.
        calls = [(runs, sizes.pop())] if len(sizes) == 1 else [([run], run[1]) for run in runs]
        completions, logprobs = [], []
        for group, n in calls:  # results come prompt-major, samples contiguous: TRL's row order
            result = self.arctic.generate([prompt for prompt, _ in group], n=n, **params)
            self._record({f"generate/{k}": v for k, v in result.metrics.items()})
            batch = result.batch
            for i in range(batch.num_responses):
                completions.append(batch.response(i))
                logprobs.append(batch.sampling_logprobs[i, : int(batch.response_lens[i])].tolist())
        return completions, logprobs

    # ---- micro-batches -------------------------------------------------------------------------

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        """TRL's, except that the micro-batches wait on the host (the backend copies what it
        needs) and each optimizer step's micro-batches keep prompt groups together.

        TRL shuffles a generation batch's rows before cutting it into micro-batches, so a
        micro-batch of 8 holds 4-6 different prompts and ZoRRo packs each of them: with 2k-token
        prompts that doubles the tokens trained. Regrouping the rows within one optimizer step
        changes which micro-batch a row is in, not which step: the summed gradient is the same
        whenever a row's weight does not depend on its micro-batch (``mapping.regroup_is_exact``).
        Where it does (bnpo, the entropy bonus, entropy masking) TRL's micro-batches are kept, so
        the loss stays TRL's exactly. Which rows share an optimizer step stays TRL's either way.
        """
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._buffered_inputs is not self._on_host:
            # Once per generation, on the host: each micro-batch's own copies would wait for the
            # backward still running on the device, which then idles while the host prepares.
            buffered = [{k: _to_host(v) for k, v in batch.items()} for batch in self._buffered_inputs]
            if regroup_is_exact(self.args):
                buffered = group_micro_batches(buffered, self.args.gradient_accumulation_steps)
            self._buffered_inputs = self._on_host = buffered
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    # ---- log-probs and loss -----------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        batch = _rollout_batch(input_ids, attention_mask, logits_to_keep)
        processors = ["logprobs", "entropy"] if compute_entropy else ["logprobs"]
        outputs = self.arctic.log_probs(batch, model="reference" if model is REFERENCE else "policy",
                                        processors=processors, temperature=self.temperature).outputs
        device = input_ids.device
        logps = _widen(outputs["logprobs"], logits_to_keep).to(device)
        entropy = _widen(outputs["entropy"], logits_to_keep).to(device) if compute_entropy else None
        return logps, entropy, None

    def training_step(self, model, inputs, num_items_in_batch=None):
        begin = time.perf_counter()
        model.train()
        metrics = self.arctic_fwd_bwd(self._prepare_inputs(inputs))  # TRL: generation, rewards, advantages
        self._record(metrics)
        self._record_as_trl(metrics)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - begin
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        loss = metrics["loss"]
        if self._filter_nan_inf and not math.isfinite(loss):  # what the Trainer's filter adds instead
            return self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
        return torch.full((), loss, device=self.args.device)  # a fill kernel: no copy that waits

    def arctic_fwd_bwd(self, inputs: dict[str, Any]) -> dict[str, float]:
        """TRL's ``_compute_loss`` + backward for one prepared micro-batch, run by the backend
        (gradients accumulate there until the optimizer step); with TRL's adaptive entropy
        controller updated as ``_compute_loss`` updates it. Returns the backend's metrics."""
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        on_policy = inputs.get("old_per_token_logps") is None
        fields = {"advantages": inputs["advantages"]}
        if not on_policy:
            fields["old_logprobs"] = inputs["old_per_token_logps"]
        if self.beta != 0.0:
            fields["ref_logprobs"] = inputs["ref_per_token_logps"]
        sampled = inputs.get("sampling_per_token_logps")
        if sampled is not None:
            fields["sampling_logprobs"] = sampled
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        batch = _rollout_batch(input_ids, attention, inputs["completion_ids"].shape[1], mask, **fields)
        floor, kept, window = self._entropy_mask(batch)
        micro = MicroBatch(self.current_gradient_accumulation_steps, int(mask.sum()),
                           float(inputs["num_items_in_batch"]),
                           self.accelerator.num_processes, on_policy, floor, kept, self._entropy_bonus(),
                           sampled is not None)
        terms, max_len = loss_terms(self.args, micro)
        metrics = dict(self.arctic.fwd_bwd(batch, terms, temperature=self.temperature,
                                           max_response_len=max_len).metrics)
        if self._entropy_bonus_enabled:  # TRL logs the loss without the bonus beside it
            self._policy_loss = policy_loss(self.args, terms, metrics, micro.accumulation_steps)
        if self.use_adaptive_entropy:
            self._update_entropy_controller(window)
        return metrics

    # ---- entropy: TRL's mask and adaptive bonus ---------------------------------------------

    def _entropy_mask(self, batch: RolloutBatch) -> tuple[float | None, int | None, torch.Tensor | None]:
        """TRL's high-entropy mask for this micro-batch as a floor (its entropy quantile), the
        tokens it keeps, and the [entropy sum, tokens] the adaptive controller accumulates; from a
        forward pass without gradient (only when entropy masking or the adaptive bonus is on)."""
        if self.top_entropy_quantile >= 1.0 and not self.use_adaptive_entropy:
            return None, None, None
        entropy = self.arctic.log_probs(batch, processors=["entropy"], temperature=self.temperature).outputs["entropy"]
        mask, floor = batch.loss_mask, None
        kept = mask
        if self.top_entropy_quantile < 1.0:
            local = entropy[mask].float()
            floor = float(torch.quantile(local, 1 - self.top_entropy_quantile)) if local.numel() else float("inf")
            kept = ((entropy * mask) >= floor) & mask
        window = torch.stack([(entropy * kept).sum(), kept.sum().float()])
        return floor, int(kept.sum()) if floor is not None else None, window

    def _entropy_bonus(self) -> float:
        """The coefficient this micro-batch applies: TRL's, gated by the adaptive controller's last
        measurement (fixed within an accumulation window)."""
        if not self._entropy_bonus_enabled:
            return 0.0
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            return 0.0
        return self.entropy_coef

    def _update_entropy_controller(self, window: torch.Tensor) -> None:
        """TRL's adaptive entropy: window-global entropy measured over the accumulation window's
        micro-batches; at the optimizer-step boundary the coefficient moves by entropy_coef_delta."""
        self._entropy_window_stats = (window if self._entropy_window_stats is None
                                      else self._entropy_window_stats + window)
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
        delta = self.args.entropy_coef_delta
        if world_entropy <= self.args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + delta, self.args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - delta, self.args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _record(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._metrics["train"][f"arctic/{key}"].append(float(value))

    def _record_as_trl(self, metrics: dict[str, float]) -> None:
        """The loss metrics TRL's ``_compute_loss`` logs, under its names, from the backend's."""
        train = self._metrics["train"]
        for theirs, value in framework_metrics(metrics, MAPPING.metric_names, policy="").items():
            train[theirs].append(float(value))
        for key, value in metrics.items():  # the policy term's, whatever its name
            theirs = SAMPLING_METRICS.get(key.partition("/")[2])
            if theirs:
                train[theirs].append(float(value))
        if "ppo/clip_low_frac" in metrics:  # the two sides never overlap
            train["clip_ratio/region_mean"].append(float(metrics["ppo/clip_low_frac"] + metrics["ppo/clip_high_frac"]))
        if self._entropy_bonus_enabled:
            train["policy_loss"].append(self._policy_loss)
            if self.accelerator.sync_gradients:
                train["entropy_coef"].append(self.entropy_coef)

    # ---- checkpoints: the weights and the optimizer live in the backend ----------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """What TRL's ``save_model`` and checkpoints write as the model: the backend's checkpoint in
        ``output_dir/arctic`` (weights, optimizer, step: what resuming loads) and the policy as a
        Hugging Face folder, linked at ``output_dir`` itself so that ``from_pretrained`` reads it."""
        folder = Path(output_dir or self.args.output_dir)
        self.arctic.save_checkpoint(str(folder / ARCTIC_CHECKPOINT), export_hf=True)
        link_export_files(folder / ARCTIC_CHECKPOINT, folder)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(folder)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Resuming: the backend loads its checkpoint (weights, optimizer, step) and its samplers
        serve those weights; TRL restores its own state (step, schedule, data order) around it."""
        self.arctic.load_checkpoint(str(Path(resume_from_checkpoint) / ARCTIC_CHECKPOINT))

    def _record_step(self, metrics: dict[str, float]) -> None:
        self._record({f"step/{k}": v for k, v in metrics.items()})

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # TRL logs the norm of the client-side placeholder's gradient (always 0): report the
        # backend's pre-clipping norm under TRL's own key instead.
        norms = self._metrics["train"].get("arctic/step/grad_norm")
        if "grad_norm" in logs and norms:
            logs["grad_norm"] = sum(norms) / len(norms)
        super().log(logs, start_time)


# The sampler correction's metrics (TRL logs vLLM's per generation; these come per micro-batch)
SAMPLING_METRICS = {"sampler_logp_diff": "sampling/sampling_logp_difference/mean",
                    "sampler_logp_diff_max": "sampling/sampling_logp_difference/max",
                    "sampler_weight_min": "sampling/importance_sampling_ratio/min",
                    "sampler_weight": "sampling/importance_sampling_ratio/mean",
                    "sampler_weight_max": "sampling/importance_sampling_ratio/max"}


def _model_folder(model: str | PreTrainedModel) -> str:
    if isinstance(model, str):  # a folder, or a Hub model fetched into the Hub's cache: the backend loads it
        return model_folder(model, "GRPOTrainer's model")
    folder = tempfile.mkdtemp(prefix="arctic-trl-policy-")  # a loaded model: hand its weights to the backend
    model.save_pretrained(folder)
    return folder


def backend_settings(arctic: ArcticClient | str | dict[str, Any] | None) -> BackendSettings:
    """The ``arctic=`` argument as the adapters' backend settings: a server's URL, or the overrides
    of the backend started in this process (a client given as it is: nothing to start)."""
    if isinstance(arctic, str):
        return BackendSettings(url=arctic)
    return BackendSettings(config=arctic if isinstance(arctic, dict) else {})


def _runs(prompts: list[Any]) -> list[tuple[Any, int]]:
    """Consecutive equal prompts (texts, messages or token lists) as (prompt, count)."""
    runs: list[tuple[Any, int]] = []
    for prompt in prompts:
        if runs and runs[-1][0] == prompt:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((prompt, 1))
    return runs


def group_micro_batches(batches: list[dict[str, Any]], window: int) -> list[dict[str, Any]]:
    """Within each window of ``window`` micro-batches (one optimizer step), reorders the rows so
    that rows with the same prompt are adjacent (groups in order of first appearance), then cuts
    the window into micro-batches of the original sizes. Per-row fields are tensors or lists
    with the rows first; 0-d tensors and ``None`` are per-batch and kept as they are."""
    out: list[dict[str, Any]] = []
    for start in range(0, len(batches), window):
        chunk = batches[start:start + window]
        rows = {k: _concat([b[k] for b in chunk]) for k, v in chunk[0].items() if _per_row(v)}
        prompts = [_token_key(ids[mask.bool()])
                   for ids, mask in zip(rows["prompt_ids"], rows["prompt_mask"], strict=True)]
        first = {p: i for i, p in reversed(list(enumerate(prompts)))}
        order = sorted(range(len(prompts)), key=lambda i: (first[prompts[i]], i))
        offset = 0
        for batch in chunk:
            size = len(batch["prompt_ids"])
            take = order[offset:offset + size]
            out.append({k: _take(rows[k], take) if k in rows else v for k, v in batch.items()})
            offset += size
    return out


def _token_key(ids: torch.Tensor) -> bytes:
    """A row's tokens as a dict key (raw bytes: a tuple of Python ints would cost far more for a long prompt)."""
    return ids.cpu().numpy().tobytes()


def _per_row(value: Any) -> bool:
    return isinstance(value, list) or (isinstance(value, torch.Tensor) and value.ndim > 0)


def _concat(parts: list[Any]) -> Any:
    return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else [x for part in parts for x in part]


def _take(values: Any, rows: list[int]) -> Any:
    return (values[torch.tensor(rows, device=values.device)] if isinstance(values, torch.Tensor)
            else [values[i] for i in rows])


def _to_host(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _rollout_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                   loss_mask: torch.Tensor | None = None, **fields: torch.Tensor) -> RolloutBatch:
    """TRL's layout (left-padded prompts + right-padded completions) as an Arctic batch."""
    cpu = {k: v.detach().cpu() for k, v in fields.items()}
    attention_mask = _with_masked_completions_attended(attention_mask.cpu(), completion_len)
    return RolloutBatch.from_padded(input_ids.cpu(), attention_mask, input_ids.shape[1] - completion_len,
                                    response_mask=None if loss_mask is None else loss_mask.cpu().bool(), **cpu)


def _with_masked_completions_attended(attention_mask: torch.Tensor, completion_len: int) -> torch.Tensor:
    """TRL's ``mask_truncated_completions`` zeroes a truncated completion's whole row of the mask.
    Its tokens are real (truncated: no EOS before the length limit, so the row is as wide as the
    batch) and its loss is masked out (``loss_mask``), so the batch keeps the row as a full-width
    response rather than an empty one, which would shrink the responses' width below the loss
    mask's. Nothing reads such a row's log-probs, so the loss and gradients are TRL's."""
    emptied = attention_mask[:, attention_mask.shape[1] - completion_len:].sum(1) == 0
    if not bool(emptied.any()):
        return attention_mask
    attention_mask = attention_mask.clone()
    attention_mask[emptied, attention_mask.shape[1] - completion_len:] = 1
    return attention_mask


def _widen(values: torch.Tensor, width: int) -> torch.Tensor:
    """Per-token outputs ``[B, longest response]`` right-padded with zeros to TRL's ``[B, width]``."""
    out = values.new_zeros(values.shape[0], width)
    out[:, : values.shape[1]] = values[:, :width]
    return out

"""The ``torch`` backends: a plain transformers model, torch AdamW, grad clipping and an LR schedule.

No DeepSpeed: simple and exact, the baseline the DeepSpeed backends and ZoRRo Train are checked
against (``options: {zorro: {enable: false}}`` runs one padded row per response).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.config import LogProbConfig, ModelConfig, StrictModel, TrainerConfig, validate_options
from arctic_core.errors import ConfigError, RequestError, engine_asleep
from arctic_core.hf import check_batch_fits, check_weights, copy_weights_, enable_gradient_checkpointing, load_causal_lm
from arctic_core.plugins.interfaces import LossContext, NamedTensors, Objective, Processor
from arctic_zorro.checkpoint_policy import fixed_layers, training_forward
from arctic_zorro.fused_elementwise import apply_compile_elementwise
from arctic_zorro.hyperparameters import Hyperparameters
from arctic_zorro.packed_forward import ZorroOptions, select_forward
from arctic_zorro.lr_schedule import lr_factor, lr_for_step
from arctic_zorro.param_groups import param_group_shapes, param_groups
from arctic_zorro.saved_state import PARAM_GROUPS, TorchTrainerState, check_layout, validated
from arctic_zorro.micro_batches import micro_forward_backward, micro_log_probs

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"


class TorchOptions(StrictModel):
    """Backend options of the torch engines (any other key is a typo)."""

    zorro: ZorroOptions = ZorroOptions()
    """Prompt-deduplicated packed forward (on by default)."""


class TorchLogProbEngine:
    """Forward-only engine over a transformers model."""

    options_model = TorchOptions
    role = "reference"
    """The server's and the client's name for this engine (what ``sleep``/``wake`` take)."""

    def __init__(self, config: LogProbConfig | TrainerConfig, model: ModelConfig, *, seed: int) -> None:
        options = validate_options(self.options_model, config, "torch")
        torch.manual_seed(seed)
        self.micro_batch_tokens = config.micro_batch_tokens
        self.model = load_causal_lm(model)
        self.model.eval()  # no dropout: RL needs the same log-probs from every forward
        self.forward = select_forward(self.model, options.zorro)
        self.zorro = options.zorro
        self.grouped = options.zorro.enable  # the packed forward wants whole prompt groups per micro-batch
        self.device = next(self.model.parameters()).device
        self.asleep = False

    def log_probs(self, batch: RolloutBatch, processors: Mapping[str, Processor]) -> dict[str, torch.Tensor]:
        self._check(batch)
        return micro_log_probs(self._micro_forward, batch, processors, self.micro_batch_tokens, self.grouped)

    def _micro_forward(self, micro: RolloutBatch, processors: Mapping[str, Processor]) -> dict[str, torch.Tensor]:
        return self.forward(self.model, micro, processors)

    def load_weights(self, weights: NamedTensors) -> None:
        copy_weights_(self.model, weights)

    def sleep(self) -> None:
        self._move("cpu")
        self.asleep = True

    def wake(self) -> None:
        self._move(self.device)
        self.asleep = False

    def shutdown(self) -> None:
        self.asleep = True

    def _move(self, device: torch.device | str) -> None:
        self.model.to(device)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _check(self, batch: RolloutBatch) -> None:
        if self.asleep:
            raise engine_asleep(self.role)
        check_batch_fits(batch, self.model)


class TorchTrainer(TorchLogProbEngine):
    """Trainable torch engine; gradients accumulate across ``forward_backward`` calls."""

    role = "trainer"

    def __init__(self, config: TrainerConfig, model: ModelConfig, *, seed: int) -> None:
        super().__init__(config, model, seed=seed)
        self.config = config
        apply_compile_elementwise(self.model, config.compile_elementwise)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(self.model, fixed_layers(config))
            self.model.train()  # transformers only checkpoints in training mode
        self.train_forward = training_forward(self._micro_forward, config, self.model, self.device, self.zorro)
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(param_groups(self.model, opt), lr=opt.lr, betas=opt.betas, eps=opt.eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(config.scheduler))
        self.configured = Hyperparameters.of(self.optimizer, self.scheduler)  # a load keeps them
        self.steps = 0

    def forward_backward(
        self, batch: RolloutBatch, objective: Objective, ctx: LossContext, scale: float = 1.0
    ) -> dict[str, float]:
        self._check(batch)
        return micro_forward_backward(
            self.train_forward, torch.Tensor.backward, batch, objective, ctx, scale,
            self.micro_batch_tokens, self.grouped, self.device,
        )

    def optimizer_step(self, lr: float | None = None) -> dict[str, float]:
        if self.asleep:
            raise engine_asleep(self.role)
        max_norm = self.config.optimizer.max_grad_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        with lr_for_step(self.optimizer, self.scheduler, lr):
            lr = self.optimizer.param_groups[0]["lr"]
            clip = max_norm if max_norm is not None else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
            if not math.isfinite(grad_norm):  # an update by NaN/inf would leave every weight NaN for good
                log.warning("gradient norm is %s: step skipped, gradients dropped", grad_norm)
                self.optimizer.zero_grad(set_to_none=True)
                return {"grad_norm": grad_norm, "lr": lr, "skipped": 1.0}
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def discard_gradients(self) -> None:
        """Forget every gradient accumulated since the last step."""
        self.optimizer.zero_grad(set_to_none=True)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated gradient of every parameter that has one (for checks and tests)."""
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def export_hf(self, path: Path) -> None:
        self.model.save_pretrained(path)

    def save_checkpoint(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.export_hf(path / "model")
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
            "rng": torch.get_rng_state(),
            "layout": self._layout(),
        }
        torch.save(state, path / STATE_FILE)

    def load_checkpoint(self, path: Path) -> None:
        """All of the checkpoint, or a RequestError and nothing changed: each part is checked against
        this trainer before any is applied."""
        state = self._read_state(path)
        check_layout(state.layout, self._layout(), path)
        model_path = path / "model"
        try:
            saved = load_causal_lm(ModelConfig(path=str(model_path), dtype=_dtype_name(self.model.dtype), device="cpu"))
        except ConfigError as exc:  # a damaged weights file, or another model's
            raise RequestError(f"checkpoint {path}: {exc}") from exc
        weights = saved.state_dict()
        check_weights(self.model, weights, str(model_path))
        self._load_optimizer(state, path)
        copy_weights_(self.model, weights.items())
        self.steps = state.steps
        torch.set_rng_state(state.rng)
        self.discard_gradients()

    def _read_state(self, path: Path) -> TorchTrainerState:
        file = path / STATE_FILE
        if not file.is_file():
            raise RequestError(f"{path} holds no torch-trainer checkpoint ({STATE_FILE} missing)")
        try:
            data = torch.load(file, weights_only=True)
        except Exception as exc:  # truncated or not a torch file: zip, pickle and OS errors alike
            raise RequestError(f"cannot read {file}: {exc}") from exc
        return validated(TorchTrainerState, data, file)

    def _load_optimizer(self, state: TorchTrainerState, path: Path) -> None:
        """The optimizer's and the LR scheduler's state, both or neither. Torch checks the optimizer's
        groups before it changes anything; the scheduler's few numbers are put back if it refuses.
        The configured hyperparameters replace the saved ones (see :mod:`arctic_zorro.hyperparameters`)."""
        scheduler_before = self.scheduler.state_dict()
        try:
            self.scheduler.load_state_dict(state.scheduler)
            self.optimizer.load_state_dict(state.optimizer)
        except (KeyError, TypeError, ValueError) as exc:
            self.scheduler.load_state_dict(scheduler_before)
            raise RequestError(f"the optimizer state in {path / STATE_FILE} does not fit this trainer: "
                               f"{type(exc).__name__}: {exc}") from exc
        self.configured.restore(self.optimizer, self.scheduler)

    def _layout(self) -> dict[str, Any]:
        return {PARAM_GROUPS: param_group_shapes(self.model, self.config.optimizer)}

    def _move(self, device: torch.device | str) -> None:
        super()._move(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

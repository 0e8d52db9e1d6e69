"""DeepSpeed engines (ZeRO stage 0-3) with exactly the torch trainer's semantics.

How gradients accumulate across an unknown number of ``forward_backward`` calls: the engine runs
with ``gradient_accumulation_steps: 1`` and ``managed_gradient_accumulation: false`` (DeepSpeed >=
0.19). In that mode ``engine.backward`` only accumulates (stage 0/1 in ``param.grad``, stage 2/3
into their gradient partitions) and ``engine.step`` is the one accumulation boundary: it reduces or
finalises the accumulated gradients, clips, updates and zeroes them. With one accumulation step,
``engine.backward`` divides the loss by 1, so the gradient is exactly the sum over calls of
``loss * scale``, as in :class:`arctic_zorro.torch_backend.TorchTrainer`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.config import LogProbConfig, ModelConfig, TrainerConfig, validate_options
from arctic_core.errors import ConfigError, RequestError, engine_asleep
from arctic_core.hf import check_batch_fits, copy_weights_, enable_gradient_checkpointing, load_causal_lm
from arctic_core.plugins.interfaces import LossContext, NamedTensors, Objective, Processor
from arctic_core.ports import free_port
from arctic_core.quiet import hide_banners
from arctic_zorro.checkpoint_policy import fixed_layers, training_forward
from arctic_zorro.fused_elementwise import apply_compile_elementwise
from arctic_zorro.hyperparameters import Hyperparameters
from arctic_zorro.lr_schedule import lr_factor, lr_for_step
from arctic_zorro.param_groups import param_group_shapes, param_groups
from arctic_zorro.saved_state import PARAM_GROUPS, TrainerState, check_layout, validated
from arctic_zorro.micro_batches import Align, micro_forward_backward, micro_log_probs
from arctic_zorro.deepspeed_options import DeepSpeedLogProbOptions, DeepSpeedTrainerOptions
from arctic_zorro.packed_forward import Forward, select_forward


def _prepare_environment() -> None:
    """Pick DeepSpeed's accelerator and a world of one before ``deepspeed`` is imported.

    DeepSpeed chooses its accelerator from ``DS_ACCELERATOR`` at import time and its comm layer
    reads the usual launcher variables. Outside a multi-process launch we are a world of one, whose
    variables are set afresh: ones inherited from a parent Arctic process (a test runner, a demo)
    would describe the parent's world. The group itself binds no port (``_init_world_of_one``).
    """
    hide_banners()
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))


_prepare_environment()

import deepspeed  # noqa: E402  (must follow _prepare_environment)
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils import safe_get_full_grad, safe_set_full_fp32_param  # noqa: E402

log = logging.getLogger(__name__)

CHECKPOINT_TAG = "arctic"
"""A fixed tag, so a checkpoint folder holds exactly one DeepSpeed checkpoint."""


def init_distributed() -> None:
    """Initialise torch.distributed once per process (every engine in it shares the group)."""
    if not deepspeed.comm.is_initialized():
        warn_of_stale_build_locks()
        # A lock younger than a build (one killed a minute ago) is named once this start has waited.
        watchdog = threading.Timer(BUILD_WAIT_S, warn_of_stale_build_locks, kwargs={"older_than": 0.0})
        watchdog.daemon = True
        watchdog.start()
        try:
            _init_world_of_one()
            with without_shm_comm_op():
                deepspeed.init_distributed(verbose=False)  # adopts a group initialised before it
        finally:
            watchdog.cancel()


@contextlib.contextmanager
def without_shm_comm_op() -> Iterator[None]:
    """DeepSpeed's comm layer on the CPU JIT-compiles a shared-memory all-reduce op when it starts
    (tens of seconds with a C++ compiler, the first time on a machine). Only its
    ``inference_all_reduce`` (tensor-parallel inference) uses the op, which Arctic never calls, and
    without it DeepSpeed falls back to torch.distributed: so the op is neither built nor loaded."""
    # By its full name: the package's attribute ``torch`` is the torch library, not this module.
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    build = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = build


def _init_world_of_one() -> None:
    """A world of one's process group on an in-process store: no rendezvous, so no port to bind.

    A port picked before the engine starts can be taken by another process in the meantime (several
    engines start side by side in one test run or one node); a world of one has no peer to meet.
    """
    backend = deepspeed.accelerator.get_accelerator().communication_backend_name()
    alone = os.environ.get("WORLD_SIZE", "1") == "1" and not torch.distributed.is_initialized()
    if alone and backend in ("nccl", "gloo"):
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)


STALE_BUILD_LOCK_S = 600.0
BUILD_WAIT_S = 120.0  # longer than a DeepSpeed op takes to build on 2 cores (~40 s)


def warn_of_stale_build_locks(older_than: float = STALE_BUILD_LOCK_S) -> None:
    """torch builds an op (DeepSpeed's CPU communication op, its fused optimizers) under a ``lock``
    file in the op's build folder; a build that was killed leaves it behind, and every later build
    of that op waits for it to go, forever and silently. Name any lock older than ``older_than``
    seconds (by default, longer than a build takes)."""
    from torch.utils.cpp_extension import get_default_build_root

    # torch's own rule: TORCH_EXTENSIONS_DIR/<op>, else <default root>/<python>_<cuda>/<op>
    root, pattern = os.environ.get("TORCH_EXTENSIONS_DIR"), "*/lock"
    if root is None:
        root, pattern = get_default_build_root(), "*/*/lock"
    now = time.time()
    for lock in Path(root).glob(pattern):
        age = now - lock.stat().st_mtime
        if age > older_than:
            log.warning("%s is %.0f s old: this process waits until that build lock is gone. A build that was "
                        "killed leaves it behind: if no other process is building that op, delete it.", lock, age)


def base_config(options: DeepSpeedLogProbOptions, model: ModelConfig) -> dict[str, Any]:
    """The DeepSpeed config shared by both engines: ZeRO stage, offload and precision."""
    if model.dtype == "float16":
        # fp16 needs loss scaling, which skips steps on overflow: the step count would drift from the torch backend.
        raise ConfigError("the deepspeed backend supports model.dtype float32 or bfloat16, not float16")
    zero: dict[str, Any] = {"stage": options.zero_stage}
    if options.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # nominal: batches are sized by micro_batch_tokens
        "zero_optimization": zero,
        "bf16": {"enabled": model.dtype == "bfloat16"},
        "steps_per_print": None,
        "wall_clock_breakdown": False,
    }
    return config


def trainer_config(options: DeepSpeedTrainerOptions, trainer: TrainerConfig, model: ModelConfig,
                   on_gpu: bool = False) -> dict[str, Any]:
    """Add the optimizer, clipping and caller-owned accumulation to :func:`base_config`. ``on_gpu``:
    the optimizer states live on a GPU, where AdamW runs fused (one kernel for the whole update
    instead of one pass over the fp32 states per element-wise operation)."""
    config = base_config(options, model)
    if model.dtype == "bfloat16":
        if options.zero_stage == 0:
            # DeepSpeed's stage 0 would step bf16 weights with bf16 gradients (no fp32 master copy).
            raise ConfigError("the deepspeed trainer needs zero_stage 1, 2 or 3 for bfloat16 (fp32 master weights)")
        config["data_types"] = {"grad_accum_dtype": "fp32"}  # sums over many calls stay accurate
    opt = trainer.optimizer
    config.update(
        gradient_accumulation_steps=1,  # engine.backward divides the loss by this: keep it 1
        managed_gradient_accumulation=False,  # accumulate until step(), however many backward calls
        gradient_clipping=opt.max_grad_norm or 0.0,
        optimizer={
            "type": "AdamW",
            "params": {
                "lr": opt.lr,
                "betas": list(opt.betas),
                "eps": opt.eps,
                "weight_decay": opt.weight_decay,
                "torch_adam": True,  # torch.optim.AdamW, like the torch backend; no op to compile
                **({"fused": True} if on_gpu and not options.offload_optimizer else {}),
            },
        },
        zero_allow_untested_optimizer=True,
        zero_force_ds_cpu_optimizer=False,  # torch AdamW also steps offloaded states on the CPU
    )
    if options.offload_optimizer:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return config


def accumulate_bf16_grads_in_one_pass(optimizer: BF16_Optimizer) -> None:
    """DeepSpeed's bf16 optimizer (bf16 at stage 1) adds each backward's bf16 gradients into its fp32
    sums, but per parameter and backward it zeroes the bf16 gradient first (so autograd adds into it
    rather than handing its result over), then copies it to fp32 and adds the copy: four kernels
    and ~4x the bytes of one add. Here ``optimizer`` drops the bf16 gradients once they are summed
    (the next backward hands each over as computed) and adds each into its fp32 sum in one
    mixed-precision add. The sums are the same bit for bit: bf16 to fp32 is exact either way."""
    own_pass = optimizer.update_hp_grads

    @torch.no_grad()
    def update_hp_grads(clear_lp_grads: bool = False) -> None:
        if getattr(optimizer, "autoep_folding_tp_group", None) is not None:
            return own_pass(clear_lp_grads)  # expert-parallel folding corrects the bf16 gradients there
        for i, group in enumerate(optimizer.bf16_groups):
            for j, lp in enumerate(group):
                if lp.grad is None:
                    continue
                hp_grad = optimizer.fp32_groups_gradients[i][j]
                hp_grad.add_(lp.grad.view(hp_grad.shape))
                lp._hp_grad = hp_grad
                optimizer.fp32_groups_has_gradients[i][j] = True
                lp.grad = None

    optimizer.update_hp_grads = update_hp_grads


class OutputsModule(torch.nn.Module):
    """What DeepSpeed wraps: ``forward(batch, processors)`` -> per-token outputs of ``model``.

    The packed forward calls the decoder and the LM head separately; running it inside
    ``engine(...)`` (not on the bare model) keeps DeepSpeed's per-forward bookkeeping, which ZeRO-3
    needs to accumulate gradients correctly over several backward passes.
    """

    def __init__(self, model: torch.nn.Module, forward: Forward) -> None:
        super().__init__()
        self.model = model
        self.run = forward

    def forward(self, batch: RolloutBatch, processors: Mapping[str, Processor]) -> dict[str, torch.Tensor]:
        return self.run(self.model, batch, processors)


class DeepSpeedLogProbEngine:
    """Forward-only engine over a transformers model wrapped by DeepSpeed."""

    options_model: type[DeepSpeedLogProbOptions] = DeepSpeedLogProbOptions
    role = "reference"
    """The server's and the client's name for this engine (what ``sleep``/``wake`` take)."""

    def __init__(self, config: LogProbConfig | TrainerConfig, model: ModelConfig, *, seed: int) -> None:
        self.options = validate_options(self.options_model, config, "deepspeed")
        torch.manual_seed(seed)
        init_distributed()
        self.micro_batch_tokens = config.micro_batch_tokens
        self.model = load_causal_lm(model)
        forward = select_forward(self.model, self.options.zorro)
        self.engine = self._initialize(OutputsModule(self.model, forward), config, model)
        self.engine.eval()  # no dropout: RL needs the same log-probs from every forward
        self.device = self.engine.device
        self.asleep = False

    def _initialize(self, module: torch.nn.Module, config: Any, model: ModelConfig) -> Any:
        ds_config = base_config(self.options, model)
        if self.options.zero_stage in (1, 2):
            # Stages 1-2 partition optimizer state and gradients, which a forward-only engine lacks
            # (DeepSpeed refuses them without an optimizer): they are stage 0 here.
            ds_config["zero_optimization"]["stage"] = 0
        engine, *_ = deepspeed.initialize(model=module, config=ds_config)
        return engine

    @property
    def zero_3(self) -> bool:
        return self.engine.zero_optimization_stage() == ZeroStageEnum.weights

    def _align(self, backward: bool = False) -> Align | None:
        """With several ranks, every rank runs the busiest rank's micro-batch count wherever each
        pass is a collective: every forward under ZeRO-3 (parameter gathers), every backward at
        any stage (ZeRO-1/2 reduce gradient buckets as each backward ends)."""
        if deepspeed.comm.get_world_size() == 1 or not (self.zero_3 or backward):
            return None

        def busiest(count: int) -> int:
            counts = torch.tensor([count], device=self.device)
            deepspeed.comm.all_reduce(counts, op=deepspeed.comm.ReduceOp.MAX)
            return int(counts.item())

        return busiest

    def log_probs(self, batch: RolloutBatch, processors: Mapping[str, Processor]) -> dict[str, torch.Tensor]:
        self._check(batch)
        grouped = self.options.zorro.enable
        return micro_log_probs(self.engine, batch, processors, self.micro_batch_tokens, grouped, self._align())

    def load_weights(self, weights: NamedTensors) -> None:
        with self._gathered(list(self.model.parameters()), modify=True):
            copy_weights_(self.model, weights)

    def sleep(self) -> None:
        self.asleep = True  # forward-only engines keep their (possibly partitioned) weights in place

    def wake(self) -> None:
        self.asleep = False

    def shutdown(self) -> None:
        self.asleep = True
        self.engine.destroy()  # drop ZeRO hooks and buffers; later engines in this process start clean

    def _gathered(self, params: list[torch.nn.Parameter], modify: bool = False) -> AbstractContextManager[Any]:
        """Full tensors of ZeRO-3 partitioned ``params`` inside the block (a no-op for stages 0-2)."""
        if not self.zero_3:
            return nullcontext()
        return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None)

    def _check(self, batch: RolloutBatch) -> None:
        if self.asleep:
            raise engine_asleep(self.role)
        check_batch_fits(batch, self.model)


class DeepSpeedTrainer(DeepSpeedLogProbEngine):
    """Trainable DeepSpeed engine; gradients accumulate across ``forward_backward`` calls until ``optimizer_step``."""

    options_model = DeepSpeedTrainerOptions
    options: DeepSpeedTrainerOptions
    role = "trainer"

    def __init__(self, config: TrainerConfig, model: ModelConfig, *, seed: int) -> None:
        self.config = config
        super().__init__(config, model, seed=seed)
        if config.gradient_checkpointing:
            self.engine.train()  # transformers only checkpoints in training mode
        self.train_forward = training_forward(self.engine, config, self.model, self.device, self.options.zorro,
                                              agree=True)
        self.configured = Hyperparameters.of(self.engine.optimizer, self.engine.lr_scheduler)  # a load keeps them
        self.steps = 0
        self.has_gradients = False  # a backward ran since the last step (DeepSpeed cannot step without one)
        self.partly_loaded: Path | None = None  # a checkpoint whose load failed part-way: calls are refused

    def _initialize(self, module: torch.nn.Module, config: Any, model: ModelConfig) -> Any:
        apply_compile_elementwise(self.model, config.compile_elementwise)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(self.model, fixed_layers(config))
        factor = lr_factor(config.scheduler)
        engine, *_ = deepspeed.initialize(
            model=module,
            model_parameters=param_groups(self.model, config.optimizer),
            config=trainer_config(self.options, config, model, on_gpu=self.model.device.type == "cuda"),
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor),
        )
        if isinstance(engine.optimizer, BF16_Optimizer) and not engine.optimizer.immediate_grad_update:
            accumulate_bf16_grads_in_one_pass(engine.optimizer)
        return engine

    def forward_backward(
        self, batch: RolloutBatch, objective: Objective, ctx: LossContext, scale: float = 1.0
    ) -> dict[str, float]:
        self._check(batch)
        self.has_gradients = True  # even a failure part-way may have added some: discard_gradients() clears them
        # engine.backward only accumulates here: step() is the one accumulation boundary.
        return micro_forward_backward(
            self.train_forward, self.engine.backward, batch, objective, ctx, scale,
            self.micro_batch_tokens, self.options.zorro.enable, self.device, self._align(backward=True),
        )

    def optimizer_step(self, lr: float | None = None) -> dict[str, float]:
        if self.asleep:
            raise engine_asleep(self.role)
        if not self.has_gradients:
            # DeepSpeed's ZeRO 1/2 step fails on an empty accumulation and stays broken after it:
            # no gradient means no update, and the schedule does not advance.
            return {"grad_norm": 0.0, "lr": self.engine.get_lr()[0], "skipped": 1.0}
        with lr_for_step(self.engine.optimizer, self.engine.lr_scheduler, lr):
            lr = self.engine.get_lr()[0]
            # A plain (non-ZeRO, fp32) optimizer clips without reporting the norm: measure it first. It
            # would also apply a NaN/inf gradient, which ZeRO's optimizers skip: skip it here as they do.
            norm_before = self._local_grad_norm() if self._grads_in_params() else None
            if norm_before is not None and not self._finite_on_every_rank(norm_before):
                self.discard_gradients()
                return {"grad_norm": float(norm_before), "lr": lr, "skipped": 1.0}
            skipped_before = self.engine.skipped_steps
            self.engine.step()  # reduce, clip, update, zero the gradients, step the LR schedule
        reported = self.engine.get_global_grad_norm()
        self.has_gradients = False
        grad_norm = float(next(n for n in (reported, norm_before, 0.0) if n is not None))
        if self.engine.skipped_steps > skipped_before:  # not finite: no update, the schedule held
            return {"grad_norm": grad_norm, "lr": lr, "skipped": 1.0}
        self.steps += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def _finite_on_every_rank(self, norm: torch.Tensor) -> bool:
        """Whether every rank's gradient norm is finite (ranks must agree to skip a step)."""
        bad = (~torch.isfinite(norm)).to(torch.int32).reshape(1).to(self.device)
        if deepspeed.comm.get_world_size() > 1:
            deepspeed.comm.all_reduce(bad, op=deepspeed.comm.ReduceOp.MAX)
        return not bool(bad.item())

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated gradient of every trainable parameter as full tensors (any ZeRO stage)."""
        pending = self._zero_1_2_pending_grads()
        # The bf16 optimizer adds each backward's param.grad into its fp32 buffers and keeps the
        # last one in param.grad: the sum is what safe_get_full_grad reads.
        grads: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            grad = pending.get(id(param)) if param.grad is None or self._bf16_optimizer else param.grad
            if grad is None:
                grad = safe_get_full_grad(param)
            if grad is not None:
                grads[name] = grad.detach().float().cpu().clone()
        return grads

    def _zero_1_2_pending_grads(self) -> dict[int, torch.Tensor]:
        """ZeRO-2's accumulated gradients before step(), by parameter id (empty for other stages).

        Without managed accumulation, stage 2 moves each backward's reduced gradients out of
        ``param.grad`` into the optimizer's ``all_grad_tensors`` (one per partitioned parameter)
        and only builds the flat partitions that ``safe_get_full_grad`` reads inside step().
        """
        optimizer = self.engine.optimizer
        tensors = getattr(optimizer, "all_grad_tensors", None)
        if self.options.zero_stage not in (1, 2) or not tensors:
            return {}
        pending: dict[int, torch.Tensor] = {}
        for group, params in enumerate(optimizer.params_in_partition):
            for param, grad in zip(params, tensors.get(group) or [], strict=False):
                pending[id(param)] = grad
        return pending

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._check_whole()
        # Gather one tensor at a time, so ZeRO-3 never holds more than one full weight extra.
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            with self._gathered([tensor]):
                full = tensor.detach().clone() if self.zero_3 else tensor.detach()
            yield name, full

    def load_weights(self, weights: NamedTensors) -> None:
        # ZeRO 1-3 step from fp32 master copies: set those too, or the next step would undo the load.
        weights = list(weights)
        super().load_weights(weights)
        if self.options.zero_stage > 0 or self.engine.bfloat16_enabled():
            params = dict(self.model.named_parameters())
            for name, tensor in weights:
                if name in params:
                    safe_set_full_fp32_param(params[name], tensor.to(self.device, torch.float32))

    def export_hf(self, path: Path) -> None:
        self.model.save_pretrained(path, state_dict=dict(self.named_weights()))

    def save_checkpoint(self, path: Path) -> None:
        self._check_whole()
        path.mkdir(parents=True, exist_ok=True)
        state = {"steps": self.steps, "rng": torch.get_rng_state(), "layout": self._layout()}
        self.engine.save_checkpoint(str(path), tag=CHECKPOINT_TAG, client_state={"arctic": state})

    def load_checkpoint(self, path: Path) -> None:
        """All of the checkpoint, or a RequestError. DeepSpeed loads the weights before it finds out
        that the optimizer state does not fit, so what it needs to match is compared first, and a
        checkpoint that does not fit changes nothing. A load that still fails part-way (a damaged
        file) leaves the trainer refusing to train, sync or save until a checkpoint loads whole. The
        configured hyperparameters replace the saved ones (see :mod:`arctic_zorro.hyperparameters`)."""
        check_layout(self._saved_state(path).layout, self._layout(), path)
        try:
            loaded, client_state = self.engine.load_checkpoint(str(path), tag=CHECKPOINT_TAG)
            state = validated(TrainerState, (client_state or {}).get("arctic"), path / CHECKPOINT_TAG)
        except Exception as exc:
            self.partly_loaded = path
            self.has_gradients = False  # nothing pending may be applied to the mixture
            raise RequestError(f"loading the checkpoint in {path} failed part-way ({type(exc).__name__}: {exc}); "
                               "the trainer is partly restored and refuses to train, sync or save until a "
                               "checkpoint loads whole: load an intact checkpoint, or restart the server") from exc
        self.configured.restore(self.engine.optimizer, self.engine.lr_scheduler)
        self.partly_loaded = None
        self.steps = state.steps
        torch.set_rng_state(state.rng)
        self.discard_gradients()  # gradients accumulated before the load belong to another state

    def _saved_state(self, path: Path) -> TrainerState:
        """The trainer's state in the checkpoint, read before DeepSpeed loads anything; its file is
        memory-mapped, so the weights saved beside it are not read."""
        files = sorted((path / CHECKPOINT_TAG).glob("*model_states.pt"))
        if not files:
            raise RequestError(f"{path} holds no DeepSpeed-trainer checkpoint (no {CHECKPOINT_TAG}/*model_states.pt)")
        try:
            saved = torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)
        except Exception as exc:  # truncated or not a torch file: zip, pickle and OS errors alike
            raise RequestError(f"cannot read {files[0]}: {exc}") from exc
        return validated(TrainerState, saved.get("arctic") if isinstance(saved, dict) else None, files[0])

    def _layout(self) -> dict[str, Any]:
        """What a saved optimizer state loads into only: the same partitioning (stages 1 and 2 share
        one), precision, number of data-parallel ranks and parameter groups."""
        stage = self.options.zero_stage
        return {"zero_stage": {0: "0", 1: "1 or 2", 2: "1 or 2", 3: "3"}[stage],
                "model.dtype": str(self.model.dtype).removeprefix("torch."),
                "data-parallel ranks": deepspeed.comm.get_world_size() if stage else "any",
                PARAM_GROUPS: param_group_shapes(self.model, self.config.optimizer)}

    def _check(self, batch: RolloutBatch) -> None:
        self._check_whole()
        super()._check(batch)

    def _check_whole(self) -> None:
        if self.partly_loaded is not None:
            raise RequestError(f"the trainer is partly restored by a failed load of {self.partly_loaded}; "
                               "load_checkpoint a checkpoint that fits it first")

    def sleep(self) -> None:
        if self._bf16_optimizer:  # it cannot move its states: refuse on any device, before anything sleeps
            raise RequestError("the deepspeed trainer cannot sleep at zero_stage 1 with model.dtype bfloat16 "
                               "(DeepSpeed's bf16 optimizer keeps its states in place); use zero_stage 2 or 3")
        # On GPU, ZeRO 1-3 can move their optimizer states and buffers out of GPU memory.
        if torch.cuda.is_available() and self.options.zero_stage > 0:
            self.engine.offload_states()
        self.asleep = True

    def wake(self) -> None:
        if torch.cuda.is_available() and self.options.zero_stage > 0:
            self.engine.reload_states()
        self.asleep = False

    @property
    def _bf16_optimizer(self) -> bool:
        """DeepSpeed's BF16_Optimizer, which bf16 at stage 1 runs (fp32 gradient accumulation)."""
        return isinstance(self.engine.optimizer, BF16_Optimizer)

    def _grads_in_params(self) -> bool:
        return self.options.zero_stage == 0 and not self.engine.bfloat16_enabled()

    def _local_grad_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    def discard_gradients(self) -> None:
        """Forget every gradient accumulated since the last step, wherever this ZeRO stage keeps
        it (as DeepSpeed's own overflow clean-up does): the next backward starts from zero."""
        self.has_gradients = False
        self.engine.zero_grad()
        optimizer = self.engine.optimizer
        if self.options.zero_stage == 0 and not self.engine.bfloat16_enabled():
            return  # torch's optimizer: the gradients live in param.grad only
        optimizer.zero_grad(set_to_none=True)  # param.grad (and ZeRO-3's accumulation counter)
        if self.options.offload_optimizer:
            optimizer.reset_cpu_buffers()
        elif self.options.zero_stage == 3:
            optimizer.averaged_gradients = {}
        for store in (getattr(optimizer, "all_grad_tensors", None), getattr(optimizer, "averaged_gradients", None)):
            for key in list(store or {}):  # ZeRO 1/2: per parameter group
                store[key] = None

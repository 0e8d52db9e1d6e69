"""The run's settings, read from PRIME-RL's ``rl.toml`` plus an ``[arctic]`` table.

The toml is the one PRIME-RL's ``rl`` launcher reads. Its ``[orchestrator]`` table goes to
PRIME-RL's orchestrator as it is (with the shared keys filled in as PRIME-RL's launcher fills them:
model, steps, sequence length, run folder); ``[trainer]`` and the shared keys configure Arctic's
trainer; ``[inference]`` is replaced by Arctic's sampler. A setting whose math Arctic does not
reproduce is refused by name; settings of PRIME-RL's own trainer and vLLM server that only tune
their speed or memory (compilation, activation checkpointing, offloading, attention kernels) have
no meaning here and are ignored (Arctic's are under ``[arctic.config]``). Any other key, in the
tables read here, is refused by name, as PRIME-RL's launcher refuses a key its config lacks.
"""

from __future__ import annotations

import tomllib
import uuid
from pathlib import Path
from typing import Any

from pydantic import Field

from arctic_core.adapters import refusals as reasons
from arctic_core.adapters.mapping import BackendInputs, backend_config, check_supported, placement
from arctic_core.adapters.settings import BackendSettings
from arctic_core.adapters.translation import overlay
from arctic_core.config import ArcticConfig, StrictModel, unknown_key, validate
from arctic_core.errors import ConfigError
from arctic_primerl.loss import loss_terms
from arctic_primerl.schedule import LRSchedule
from arctic_primerl.trainer import RunFolder
from arctic_primerl.wire import PRIME_RL_VERSION


class ArcticSection(BackendSettings):
    """``[arctic]``: where the backend runs (see BackendSettings), and where PRIME-RL is served."""

    host: str = "127.0.0.1"
    """Interface of the inference front PRIME-RL's processes call."""
    orchestrator_command: list[str] = Field(default_factory=lambda: ["orchestrator"])
    """How to start PRIME-RL's orchestrator (its console script, in PRIME-RL's environment)."""
    env_server_command: list[str] = Field(default_factory=lambda: ["env-server"])
    """How to start one of PRIME-RL's environment servers."""
    max_model_len: int | None = None
    """Context the front announces and checks requests against (default: seq_len)."""


# Keys of [trainer] that change what is computed and that Arctic does not reproduce.
REFUSED = {
    ("model", "lora"): f"LoRA ({reasons.FULL_WEIGHTS})",
    ("model", "quantization"): "FP8 training",
    ("model", "freeze_moe_router"): "a frozen MoE router",
    ("enable_router_replay",): "routed-expert replay",
    ("data", "fake"): "a fake data loader",
}

# Keys of [trainer] that only tune the speed, memory or profiling of PRIME-RL's own trainer process:
# accepted and ignored, as those of [trainer.model] are (see the module's docstring).
TRAINER_IGNORED = {"matmul_precision", "gc", "memory_profiler_path", "trace_path", "dist_timeout_seconds"}

# Keys of [ckpt] and [trainer.ckpt] refused by name: Arctic saves and loads its checkpoints whole.
CKPT_REFUSED = ("output_dir", "skip_progress", "skip_scheduler", "skip_dataloader", "skip_optimizer")


class RunSettings(StrictModel):
    """What ``arctic-primerl rl`` needs from the toml, validated."""

    model_name: str
    max_steps: int = Field(gt=0)
    seq_len: int = Field(2048, gt=0)
    run_dir: Path
    port: int = 8000
    loss: list[dict[str, Any]]
    schedule: LRSchedule
    optimizer: dict[str, Any]
    checkpoints: bool = False
    """A [ckpt] table is set: save at its interval and after the last step, as PRIME-RL does."""
    ckpt_interval: int | None = None
    ckpt_keep_last: int | None = None
    ckpt_keep_interval: int | None = None
    resume_step: int | None = None
    clean: bool = False
    """Remove an earlier run's steps from the run folder before starting (PRIME-RL's ``clean``)."""
    process_env: dict[str, str] = {}
    """Environment variables of the orchestrator and env servers ([env_vars], [orchestrator.env_vars])."""
    backend_env: dict[str, str] = {}
    """Environment variables of this process, which trains and samples in PRIME-RL's trainer's and
    inference server's stead ([env_vars], [trainer.env_vars], [inference.env_vars])."""
    orchestrator: dict[str, Any]
    arctic: ArcticSection

    def arctic_config(self, on_gpu: bool) -> ArcticConfig:
        """The backend the adapter starts: PRIME-RL's model and optimizer, Arctic's engines
        (``[arctic.config]`` overrides engine choices)."""
        return backend_config(MAPPING, self, self.arctic, on_gpu)

    def orchestrator_config(self) -> dict[str, Any]:
        """PRIME-RL's orchestrator table, with the shared keys as its launcher fills them and the
        transports Arctic serves (files both ways)."""
        shared = {"model": {"name": self.model_name, "client": {"base_url": f"http://{self.arctic.host}:{self.port}/v1"}},
                  "max_steps": self.max_steps, "seq_len": self.seq_len, "output_dir": str(self.run_dir),
                  "rollout_transport": {"type": "filesystem"}, "weight_broadcast": {"type": "filesystem"},
                  "num_train_workers": 1}
        return overlay(self.orchestrator, shared)


def read_run(path: Path) -> RunSettings:
    """Parse and check ``rl.toml``: a ConfigError lists every setting Arctic does not reproduce, or
    else names the first other problem by its key."""
    with path.open("rb") as f:
        try:
            raw = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    trainer, orchestrator = raw.get("trainer", {}), raw.get("orchestrator", {})
    arctic = validate(ArcticSection, raw.get("arctic", {}), "[arctic] table", prefix="arctic.")
    check_supported(MAPPING, raw, arctic)
    _check_keys(raw)  # after the refusals: a refused setting's keys are named by its refusal, not as unknown
    model_name = _shared(raw, ("model", "name"), trainer, orchestrator)
    max_steps = _shared(raw, ("max_steps",), trainer, orchestrator)
    if model_name is None or max_steps is None:
        raise ConfigError(f"{path}: set model.name and max_steps (as PRIME-RL's rl launcher needs them)")
    if type(max_steps) is not int or max_steps < 1:
        raise ConfigError(f"max_steps = {max_steps!r}: a number of steps, at least 1")
    seq_len = _shared(raw, ("seq_len",), {"seq_len": _get(trainer, ("model", "seq_len"))}, orchestrator) or 2048
    optim = trainer.get("optim", {})
    lr = optim.get("lr", 1e-6)
    optimizer = {"lr": lr, "weight_decay": optim.get("weight_decay", 0.01), "max_grad_norm": optim.get("max_norm", 1.0),
                 "betas": (optim.get("betas1", 0.9), optim.get("betas2", 0.999))}
    ckpt, resume = _ckpt_and_resume(raw)
    resuming = "resume" in raw or "resume" in trainer
    run_dir = run_folder(raw, model_name, orchestrator, resuming)
    resume_step = resume.get("step")
    if resuming and resume_step is None:  # an empty [resume]: the latest checkpoint
        resume_step = latest_checkpoint(run_dir)
    port = raw.get("inference", {}).get("server", {}).get("port", 8000)
    return RunSettings(
        model_name=model_name, max_steps=max_steps, seq_len=seq_len, run_dir=run_dir, port=port,
        loss=MAPPING.loss_terms(raw), optimizer=optimizer,
        schedule=LRSchedule.from_prime_rl(trainer.get("scheduler", {}), lr, max_steps),
        checkpoints="ckpt" in raw or "ckpt" in trainer, ckpt_interval=ckpt.get("interval"),
        ckpt_keep_last=ckpt.get("keep_last"), ckpt_keep_interval=ckpt.get("keep_interval"), resume_step=resume_step,
        clean=bool(raw.get("clean", False)), orchestrator=with_shared_sections(raw, orchestrator),
        process_env=_env_vars(raw, "orchestrator"), backend_env=_env_vars(raw, "trainer", "inference"),
        arctic=arctic,
    )


DEFAULT_OUTPUT_DIR = "runs/primerl"


def run_folder(raw: dict[str, Any], model_name: str, orchestrator: dict[str, Any], resuming: bool) -> Path:
    """PRIME-RL's run folder: ``output_dir / run.dir`` (default ``run.name``); with neither, a new
    folder at every launch, named ``<envs>--<model>--<8 hex digits>`` as PRIME-RL names it.
    ``output_dir`` defaults to ``runs/primerl`` (PRIME-RL's own default, ``outputs``, would put the
    runs of a checkout beside its sources)."""
    run = raw.get("run", {})
    name = run.get("dir") or run.get("name")
    if name is None:
        if resuming:
            raise ConfigError("[resume] needs run.name (or run.dir) naming the run to resume: without one every "
                              "launch starts a new run folder")
        sources = orchestrator.get("train", {}).get("source", [])
        envs = "+".join(dict.fromkeys(source_name(source) for source in sources))
        name = f"{envs or 'no-env'}--{model_name.split('/')[-1]}--{uuid.uuid4().hex[:8]}".lower()
    return Path(raw.get("output_dir", DEFAULT_OUTPUT_DIR)) / name


def source_name(source: dict[str, Any]) -> str:
    """An environment source's name: its own, else its taskset's id (PRIME-RL's resolved name)."""
    return source.get("name") or source.get("env", {}).get("taskset", {}).get("id") or "env"


def latest_checkpoint(run_dir: Path) -> int:
    steps = RunFolder(run_dir).checkpoint_steps()
    if not steps:
        raise ConfigError(f"[resume] without a step resumes from the latest checkpoint, but {run_dir / 'checkpoints'} "
                          "holds none")
    return max(steps)


# The top-level tables PRIME-RL's rl launcher copies into the orchestrator's config (a key the
# orchestrator's own table sets is kept): its checkpoints and resume step must match the trainer's.
SHARED_WITH_ORCHESTRATOR = {
    "ckpt": ("interval", "keep_last", "keep_interval"), "resume": ("step",), "log": ("level", "json_logging"),
    "tokenizer": ("name", "trust_remote_code", "chat_template"),
}


def with_shared_sections(raw: dict[str, Any], orchestrator: dict[str, Any]) -> dict[str, Any]:
    shared: dict[str, Any] = {}
    for section, keys in SHARED_WITH_ORCHESTRATOR.items():
        if section in raw:  # a bare [ckpt] or [resume] turns the section on for the orchestrator too
            shared[section] = {key: raw[section][key] for key in keys if key in raw[section]}
    if "monitors" in raw:
        shared["monitors"] = raw["monitors"]
    return overlay(shared, orchestrator)


# The keys read_run takes in each table it reads: to use, to refuse by name, to hand to PRIME-RL's
# orchestrator, or (TRAINER_IGNORED) to ignore. Tables not checked here: [orchestrator] and [monitors]
# go to PRIME-RL's orchestrator whole, which validates them itself when it starts; [inference]
# configures PRIME-RL's vLLM server, which Arctic's sampler replaces (only server.port is read);
# [trainer.model] holds PRIME-RL's many model settings, of which REFUSED and the seq_len and
# parallelism checks read a few and the rest (speed, memory) are ignored; [trainer.loss] and
# [trainer.scheduler] are checked by type where they are read (loss.py, schedule.py).
_CKPT_KEYS = {"interval", "keep_last", "keep_interval", *CKPT_REFUSED}
_TRANSPORT_KEYS = {"type"}  # the filesystem transports have no other (other types are refused first)
KNOWN_KEYS: dict[tuple[str, ...], set[str]] = {
    (): {"trainer", "orchestrator", "inference", "arctic", "model", "max_steps", "seq_len", "output_dir", "run",
         "clean", "ckpt", "resume", "log", "tokenizer", "monitors", "weight_broadcast", "rollout_transport",
         "deployment", "env_vars"},
    ("trainer",): {"model", "data", "loss", "optim", "scheduler", "max_steps", "ckpt", "resume", "weight_broadcast",
                   "rollout_transport", "enable_router_replay", "env_vars", *TRAINER_IGNORED},
    ("trainer", "data"): {"fake"},
    ("trainer", "optim"): {"type", "lr", "weight_decay", "max_norm", "betas1", "betas2"},
    ("ckpt",): _CKPT_KEYS, ("trainer", "ckpt"): _CKPT_KEYS,
    ("resume",): {"step", "dir"}, ("trainer", "resume"): {"step", "dir"},
    ("model",): {"name"}, ("run",): {"name", "dir"},
    ("deployment",): {"type", "gpus_per_node", "num_train_gpus", "num_infer_gpus"},
    ("log",): set(SHARED_WITH_ORCHESTRATOR["log"]), ("tokenizer",): set(SHARED_WITH_ORCHESTRATOR["tokenizer"]),
    ("weight_broadcast",): _TRANSPORT_KEYS, ("rollout_transport",): _TRANSPORT_KEYS,
    ("trainer", "weight_broadcast"): _TRANSPORT_KEYS, ("trainer", "rollout_transport"): _TRANSPORT_KEYS,
}


def _check_keys(raw: dict[str, Any]) -> None:
    """The first key of a table in KNOWN_KEYS that is not known there, named with its table."""
    for path, known in KNOWN_KEYS.items():
        table = _get(raw, path)
        for key in table if isinstance(table, dict) else ():
            if key not in known:
                where = f" in [{'.'.join(path)}]" if path else " at the top level"
                raise ConfigError(f"{'.'.join((*path, key))}: {unknown_key(key, known, where)}")


def _env_vars(raw: dict[str, Any], *sections: str) -> dict[str, str]:
    """[env_vars] overlaid with each section's own ``env_vars``, as PRIME-RL's launcher sets them in
    the processes of those sections (strings only: they become environment variables)."""
    merged: dict[str, str] = {}
    for path in (("env_vars",), *((section, "env_vars") for section in sections)):
        table = _get(raw, path) or {}
        if not isinstance(table, dict) or not all(isinstance(value, str) for value in table.values()):
            raise ConfigError(f"{'.'.join(path)}: a table of environment variables with string values")
        merged.update(table)
    return merged


def _get(table: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(table, dict) or key not in table:
            return None
        table = table[key]
    return table


def _shared(raw: dict[str, Any], keys: tuple[str, ...], *sections: dict[str, Any]) -> Any:
    """A shared key, from the top level or any section; sections that set it must agree."""
    values = {repr(v): v for v in (_get(raw, keys), *(_get(s, keys) for s in sections)) if v is not None}
    if len(values) > 1:
        raise ConfigError(f"{'.'.join(keys)} differs between sections: {sorted(values)}")
    return next(iter(values.values()), None)


def refusals(raw: dict[str, Any], settings: BackendSettings) -> list[str]:
    """Every setting of ``rl.toml`` whose math or placement Arctic does not reproduce."""
    trainer, orchestrator = raw.get("trainer", {}), raw.get("orchestrator", {})
    found = [f"trainer.{'.'.join(keys)}: {what} is not supported by arctic-primerl"
             for keys, what in REFUSED.items() if _get(trainer, keys) not in (None, False, {})]
    found += _transport_refusals(raw, trainer, orchestrator) + _deployment_refusals(raw.get("deployment", {}), trainer)
    if _get(trainer, ("optim", "type")) not in (None, "adamw"):
        found.append(f"trainer.optim.type = {trainer['optim']['type']!r}: arctic-primerl trains with AdamW")
    ckpt, resume = _ckpt_and_resume(raw)
    found += [f"ckpt.{key}: not supported by arctic-primerl (checkpoints go under the run folder, whole)"
              for key in CKPT_REFUSED if ckpt.get(key) not in (None, False)]
    if "dir" in resume:
        found.append("resume.dir: arctic-primerl resumes from this run's own checkpoints (resume.step)")
    return found


def _ckpt_and_resume(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The [ckpt] and [resume] tables, the trainer's own keys over the shared ones."""
    trainer = raw.get("trainer", {})
    return {**raw.get("ckpt", {}), **trainer.get("ckpt", {})}, {**raw.get("resume", {}), **trainer.get("resume", {})}


def _transport_refusals(raw: dict[str, Any], trainer: dict[str, Any], orchestrator: dict[str, Any]) -> list[str]:
    found = []
    for key, served in (("weight_broadcast", "the sampler is synced in memory"),
                        ("rollout_transport", "rollouts are read from files")):
        for where, table in (("", raw), ("trainer.", trainer), ("orchestrator.", orchestrator)):
            kind = _get(table, (key, "type"))
            if kind not in (None, "filesystem"):
                found.append(f"{where}{key}.type = {kind!r}: arctic-primerl serves 'filesystem' ({served}); "
                             "remove the setting")
    return found


def _deployment_refusals(deployment: dict[str, Any], trainer: dict[str, Any]) -> list[str]:
    found = []
    if deployment.get("type", "single_node") != "single_node":
        found.append(f"deployment.type = {deployment['type']!r}: arctic-primerl runs on one node; Arctic "
                     "spreads its engines over GPUs itself ([arctic.config])")
    for key in ("num_train_gpus", "num_infer_gpus"):
        if deployment.get(key, 1) != 1:
            found.append(f"deployment.{key} = {deployment[key]}: Arctic places its engines itself; give GPUs to "
                         "[arctic.config] (trainer.backend = 'ray', sampler replicas) instead")
    for key in ("cp", "dp_replicate"):
        if _get(trainer, ("model", key)) not in (None, 1):
            found.append(f"trainer.model.{key}: PRIME-RL's parallelism settings do not apply; "
                         "Arctic's are in [arctic.config]")
    return found


def backend_inputs(run: RunSettings, on_gpu: bool) -> BackendInputs:
    """PRIME-RL's model and optimizer; bf16 on a GPU, fp32 on the CPU (the device is Arctic's choice)."""
    return BackendInputs(model_path=run.model_name, optimizer=run.optimizer, dtype=placement(on_gpu)["dtype"])


class PrimeRLMapping:
    """PRIME-RL's ``rl.toml`` in Arctic's terms (see :class:`arctic_core.adapters.mapping.FrameworkMapping`).
    PRIME-RL is not a package of the environment Arctic runs in (its processes run in their own):
    the release the adapter speaks to is the one its wire format was recorded from."""

    adapter, framework, supported = "arctic-primerl", "prime-rl", (PRIME_RL_VERSION, "0.9")
    owner = "PRIME-RL's own settings (model.name, [trainer.optim], [trainer.scheduler])"
    metric_names: dict[str, str] = {}  # the trainer logs Arctic's metrics under their own names
    refusals = staticmethod(refusals)
    backend_inputs = staticmethod(backend_inputs)

    @staticmethod
    def loss_terms(raw: dict[str, Any]) -> list[dict[str, Any]]:
        return loss_terms(raw.get("trainer", {}).get("loss"))


MAPPING = PrimeRLMapping()

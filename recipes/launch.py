"""Run a recipe through verl on Arctic from its YAML, or check it first without GPUs.

    python -m recipes.launch recipes/text_to_sql/verl_32gpu.yaml --set data.train_files=~/data/bird/train.parquet
    python -m recipes.launch recipes/text_to_sql/verl_32gpu.yaml --dry-run

A recipe YAML holds ``cluster`` (``nodes``, ``gpus_per_node``), ``reward`` (the recipe's reward file,
relative to the repository root), ``verl`` (``main_ppo``'s settings as dotted keys), ``arctic``
(the backend's configuration, ``+arctic.config.*``) and ``arctic_server`` (``+arctic.num_gpus``
and the like). ``--dry-run`` composes verl's config exactly as ``main_ppo`` would, runs
the start-up checks on it (arctic-verl's and verl's own, and that the model, the data files and
the reward file are there), validates every Ray engine's options, places the engines' Ray actors
on the cluster's GPUs and prints that plan with the command, or every problem it found, each
naming its setting; it needs verl's environment, no GPU, and writes nothing.

``--set KEY=VALUE`` (the value read as YAML) changes one setting: a verl key as on ``main_ppo``'s
command line, except that ``trainer.nnodes`` and ``trainer.n_gpus_per_node`` (or ``cluster.nodes``,
``cluster.gpus_per_node``) change ``cluster``, which the placement reads; ``arctic.<path>`` (or
verl's spelling ``arctic.config.<path>``) a key of the ``arctic`` section; ``arctic.<setting>``
for the server's settings (``num_gpus``, ``num_cpus``, ...) or ``arctic_server.<setting>`` a key
of ``arctic_server``. The launcher adds Hydra's ``+`` to the arctic keys itself.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from recipes.common import parse_value

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Actor:
    engine: str
    index: int
    gpus: float
    hosts: tuple[str, ...] = ()  # engines running inside this actor

    def label(self) -> str:
        inside = f" ({', '.join(self.hosts)})" if self.hosts else ""
        return f"{self.engine}[{self.index}]:{self.gpus:g}{inside}"


def hydra_value(value: object) -> str:
    """A value as Hydra reads it on the command line."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if value is None:
        return "null"
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else str(value)


def flatten(section: dict, prefix: str) -> list[str]:
    items = []
    for key, value in section.items():
        if isinstance(value, dict) and value:
            items += flatten(value, f"{prefix}{key}.")
        else:
            items.append(f"{prefix}{key}={hydra_value(value)}")
    return items


# verl's names for the cluster's settings: set through ``cluster`` so the placement sees them too.
CLUSTER_KEYS = {"trainer.nnodes": "nodes", "trainer.n_gpus_per_node": "gpus_per_node"}
SECTIONS = ("cluster", "arctic", "arctic_server")


def load(path: Path, overrides: list[str]) -> dict:
    """The recipe with the ``--set`` overrides applied; SystemExit naming what is wrong."""
    recipe = yaml.safe_load(path.read_text())
    missing = {"cluster", "verl"} - set(recipe if isinstance(recipe, dict) else {})
    if missing:
        raise SystemExit(f"{path}: missing sections {sorted(missing)}")
    if not isinstance(recipe["verl"], dict):
        raise SystemExit(f"{path}: verl must map verl's dotted keys to values, got {recipe['verl']!r}")
    for key in recipe["verl"]:
        if key.lstrip("+") in CLUSTER_KEYS:
            raise SystemExit(f"{path}: set cluster.{CLUSTER_KEYS[key.lstrip('+')]} instead of verl's {key} "
                             "(the placement reads cluster)")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected key=value")
        section, keys = route(key.strip())
        if section == "verl":
            recipe["verl"][key.strip()] = parse_value(value)
        else:
            assign(recipe, section, keys, parse_value(value), item)
    check_cluster(recipe["cluster"], path)
    return recipe


def route(key: str) -> tuple[str, list[str]]:
    """The recipe section a ``--set`` key edits and the key's path inside it (``verl``: the key)."""
    name = key.lstrip("+")  # the launcher adds Hydra's + to the arctic keys itself
    if name in CLUSTER_KEYS:
        return "cluster", [CLUSTER_KEYS[name]]
    head, _, rest = name.partition(".")
    if head == "arctic":
        first, _, inner = rest.partition(".")
        if first == "config":  # verl's own spelling of the arctic section
            return "arctic", inner.split(".")
        return ("arctic_server" if first in server_settings() else "arctic"), rest.split(".")
    if head in SECTIONS:
        return head, rest.split(".")
    return "verl", [key]


def server_settings() -> set[str]:
    """The keys of verl's ``arctic`` section that configure the server rather than the backend."""
    from arctic_verl.settings import ArcticSettings

    return set(ArcticSettings.model_fields) - {"config"}


def assign(recipe: dict, section: str, keys: list[str], value: object, item: str) -> None:
    """``recipe[section][k1][k2]... = value``, creating the mappings on the way."""
    if not all(keys):
        raise SystemExit(f"--set {item!r}: name a key inside {section} (for example {section}.<key>=<value>)")
    node = recipe.get(section) or {}
    recipe[section] = node
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise SystemExit(f"--set {item!r}: {section}.{'.'.join(keys[:depth + 1])} is {child!r}, not a mapping")
        node = child
    node[keys[-1]] = value


def check_cluster(cluster: object, path: Path) -> None:
    if not isinstance(cluster, dict):
        raise SystemExit(f"{path}: cluster must hold nodes and gpus_per_node, got {cluster!r}")
    for key in ("nodes", "gpus_per_node"):
        value = cluster.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            verl_key = next(k for k, v in CLUSTER_KEYS.items() if v == key)
            raise SystemExit(f"cluster.{key} (verl's {verl_key}) must be a positive whole number, got {value!r}")


def require_verl() -> None:
    """The launcher runs ``main_ppo`` with this interpreter and the dry run imports verl here:
    one line naming the environment to use when this one lacks verl or arctic-verl."""
    missing = [name for name in ("verl", "arctic_verl") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"recipes.launch needs verl and arctic-verl, and this Python ({sys.executable}) has no "
                         f"{' or '.join(missing)}: run it in verl's environment (UV_PROJECT_ENVIRONMENT=.venv-verl "
                         "uv run --extra verl python -m recipes.launch ...) or install arctic-verl next to verl")


def overrides(recipe: dict) -> list[str]:
    """``main_ppo``'s command-line overrides for the recipe."""
    cluster = recipe["cluster"]
    items = ["trainer.v1.trainer_mode=arctic", f"trainer.nnodes={cluster['nodes']}",
             f"trainer.n_gpus_per_node={cluster['gpus_per_node']}"]
    if recipe.get("reward"):
        items += [f"reward.custom_reward_function.path={ROOT / recipe['reward']}",
                  "reward.custom_reward_function.name=compute_score"]
    items += [f"{key}={hydra_value(value)}" for key, value in recipe["verl"].items()]
    items += ["+" + item for item in flatten(recipe.get("arctic") or {}, "arctic.config.")]
    items += ["+" + item for item in flatten(recipe.get("arctic_server") or {}, "arctic.")]
    return items


def engine_actors(config, settings, cluster_has_gpus: bool) -> list[Actor]:
    """The Ray actors the backend will start and the GPUs each asks for (engines that are not Ray
    backends run inside the server actor)."""
    from arctic_core.config import validate_options
    from arctic_core.ray.logprob import RayLogProbOptions
    from arctic_core.ray.sampler import RaySamplerOptions
    from arctic_core.ray.trainer import RayTrainerOptions

    server_gpus = settings.num_gpus if settings.num_gpus is not None else float(cluster_has_gpus)
    engines = {"trainer": config.trainer, "sampler": config.sampler, "reference": config.reference}
    inside = tuple(name for name, engine in engines.items() if engine is not None and engine.backend != "ray")
    actors = [Actor("server", 0, server_gpus, inside)]
    if config.trainer.backend == "ray":
        options = validate_options(RayTrainerOptions, config.trainer, "trainer")
        actors += [Actor("trainer", i, options.gpus_per_worker) for i in range(options.workers)]
    if config.sampler.backend == "ray":
        options = validate_options(RaySamplerOptions, config.sampler, "sampler")
        actors += [Actor("sampler", i, options.gpus_per_replica) for i in range(options.replicas)]
    if config.reference is not None and config.reference.backend == "ray":
        actors.append(Actor("reference", 0, validate_options(RayLogProbOptions, config.reference, "reference").gpus))
    return actors


def place(actors: list[Actor], nodes: int, gpus_per_node: int) -> dict[int, list[Actor]]:
    """First-fit of the actors (largest first) onto the nodes' GPUs, as Ray's resource accounting
    allows; SystemExit when they do not fit."""
    free, plan = [float(gpus_per_node)] * nodes, {n: [] for n in range(nodes)}
    for actor in sorted(actors, key=lambda a: -a.gpus):
        node = next((n for n in range(nodes) if free[n] + 1e-9 >= actor.gpus), None)
        if node is None:
            need = sum(a.gpus for a in actors)
            raise SystemExit(f"the engines need {need:g} GPUs ({actor.engine} {actor.index} asks for {actor.gpus:g}); "
                             f"the cluster has {nodes} x {gpus_per_node}")
        free[node] -= actor.gpus
        plan[node].append(actor)
    return plan


# The verl settings the start-up checks read (lengths: the rollout's, which verl sets from data.*).
MODEL_KEY = "actor_rollout_ref.model.path"
PROMPT_KEY, RESPONSE_KEY = "actor_rollout_ref.rollout.prompt_length", "actor_rollout_ref.rollout.response_length"
DATA_KEYS = ("data.train_files", "data.val_files")
REWARD_KEY = "reward.custom_reward_function.path"
STARTUP_KEYS = (MODEL_KEY, PROMPT_KEY, RESPONSE_KEY, *DATA_KEYS, REWARD_KEY)
LENGTHS = f"{PROMPT_KEY} + response_length (data.max_prompt_length + data.max_response_length unless set)"
DATA_FIX = "run the recipe's prepare_data (its README says how) or --set {key}=PATH"
REWARD_FIX = "set the recipe's reward: (relative to the repository root) or --set {key}=PATH"
# What a failed check raises besides ArcticError: verl's checks (bare asserts among them), a model
# config that cannot be read, and the placement's SystemExit.
REFUSALS = (AssertionError, ValueError, TypeError, OSError, SystemExit)


def attempt(problems: list[str], check: Callable, *args, whose: str = "Arctic's"):
    """``check(*args)``; when it refuses, its reason joins ``problems`` and the result is None, so
    that one run reports every problem, not the first."""
    from arctic_core.adapters.preflight import describe
    from arctic_core.errors import ArcticError

    try:
        return check(*args)
    except (ArcticError, *REFUSALS) as exc:
        problems.append(describe(exc, whose) if not isinstance(exc, SystemExit) else str(exc.code))
        return None


def check_model(key: str, path: str) -> str | None:
    """Raise naming ``key`` when the model at ``path`` is not here: a missing path, a folder with
    no config.json. A Hub model id not in the cache is the run's to fetch (the dry run does not
    download it): a note, unless the Hub is switched off (``HF_HUB_OFFLINE``)."""
    from huggingface_hub import constants

    from arctic_core.model_folders import cached_model_folder, hub_id, model_folder

    if hub_id(path) and not constants.HF_HUB_OFFLINE and cached_model_folder(path) is None:
        return (f"{key}: {path!r} is no local folder, so the run fetches it from the Hugging Face Hub as a "
                "model id; the dry run checks its positions once it is in the cache")
    model_folder(path, key, fetch=False)
    return None


def missing_files(key: str, value: object, fix: str) -> list[str]:
    """A problem for each path in ``value`` (one path or a list, as verl takes them) that is not
    here. Relative paths are read from the repository root, where the launcher runs main_ppo;
    remote ones (hdfs://...) verl copies at start, so they are not checked here."""
    paths = [] if value is None else [value] if isinstance(value, str) else list(value)
    problems = []
    for path in map(str, paths):
        if "://" not in path and not (ROOT / os.path.expanduser(path)).exists():
            where = "" if os.path.isabs(os.path.expanduser(path)) else f" (read from {ROOT})"
            problems.append(f"{key}: {path!r} does not exist{where}: {fix.format(key=key)}")
    return problems


def startup_problems(settings: Mapping[str, object]) -> tuple[list[str], list[str]]:
    """The problems and notes of the model, the lengths, the data and the reward file in verl's
    ``settings`` (each of STARTUP_KEYS -> its value); needs no verl."""
    from arctic_core.adapters.preflight import check_positions

    problems: list[str] = []
    model = str(settings[MODEL_KEY])
    with contextlib.chdir(ROOT):  # main_ppo runs from the repository root: a relative path is read from there
        note = attempt(problems, check_model, MODEL_KEY, model)
        # arctic-verl's own check; it skips a model that is not here (reported just above)
        attempt(problems, check_positions, model, settings[PROMPT_KEY] + settings[RESPONSE_KEY], LENGTHS)
    for key in DATA_KEYS:
        problems += missing_files(key, settings.get(key), DATA_FIX)
    problems += missing_files(REWARD_KEY, settings.get(REWARD_KEY), REWARD_FIX)
    return problems, [note] if note else []


def verl_problems(config) -> list[str]:
    """verl's own ``validate_config``, as main_ppo runs it before Ray starts. arctic-verl wraps it to
    run its checks first, stopping at the first problem; the dry run runs those itself, so it hands
    verl's a copy that does not ask for Arctic. verl's prints (a success line) are left out."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    plain = copy.deepcopy(config)
    OmegaConf.update(plain, "trainer.v1.trainer_mode", "dry-run")
    problems: list[str] = []
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # verl's notices about its own engines
        attempt(problems, lambda: validate_config(plain, need_reference_policy(plain), need_critic(plain)),
                whose="verl's")
    return [f"verl's config check: {problem}" for problem in problems]


def arctic_problems(config, cluster: dict) -> tuple[list[str], object, dict | None]:
    """arctic-verl's start-up checks (as its preflight runs them in main_ppo, every one reported),
    then the engines placed: the problems, Arctic's config and the plan (None where not reached)."""
    from arctic_core.adapters.preflight import check_server
    from arctic_core.plugins.checks import check_plugins
    from arctic_core.plugins.registry import default_registry
    from arctic_verl.mapping import arctic_config, get, refusals
    from arctic_verl.settings import read_settings

    problems: list[str] = []
    settings = attempt(problems, read_settings, config)
    if settings is None:
        return problems, None, None
    problems += refusals(config, settings)
    if settings.url:
        from verl.trainer.ppo.utils import need_reference_policy

        needs = "verl's KL (use_kl_loss / use_kl_in_reward)" if need_reference_policy(config) else None
        attempt(problems, check_server, settings, str(get(config, MODEL_KEY)), MODEL_KEY, needs)
    arctic = attempt(problems, arctic_config, config, settings, True)
    if arctic is None:
        return problems, None, None
    attempt(problems, check_plugins, arctic, default_registry())
    if arctic.reference is not None and arctic.reference.model is not None:
        attempt(problems, check_model, "arctic.config.reference.model.path", arctic.reference.model.path)
    actors = attempt(problems, engine_actors, arctic, settings, True)
    plan = attempt(problems, place, actors, cluster["nodes"], cluster["gpus_per_node"]) if actors else None
    return problems, arctic, plan


def dry_run(recipe: dict) -> str:
    """Compose verl's config, run the start-up checks and place the engines; the plan as text, or
    SystemExit listing every problem."""
    import verl

    from arctic_verl.mapping import get

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    config = compose_verl(config_dir, overrides(recipe))
    cluster = recipe["cluster"]
    problems, notes = startup_problems({key: get(config, key) for key in STARTUP_KEYS})
    problems += verl_problems(config)
    found, arctic, plan = arctic_problems(config, cluster)
    problems += found
    if problems:
        raise SystemExit(f"the dry run found {len(problems)} problem(s), each of which stops main_ppo:\n"
                         + "\n".join("  - " + problem.replace("\n", "\n    ") for problem in problems)
                         + "".join(f"\nnote: {note}" for note in notes))
    lines = [f"model: {arctic.model.path} ({arctic.model.dtype}); trainer: {arctic.trainer.backend} "
             f"{arctic.trainer.options}; sampler: {arctic.sampler.backend} {arctic.sampler.options}",
             f"placement on {cluster['nodes']} nodes x {cluster['gpus_per_node']} GPUs:"]
    for node, actors in plan.items():
        used = sum(a.gpus for a in actors)
        names = ", ".join(a.label() for a in sorted(actors, key=lambda a: (a.engine, a.index)))
        lines.append(f"  node {node}: {used:g}/{cluster['gpus_per_node']} GPUs  {names or '-'}")
    return "\n".join(lines + [f"note: {note}" for note in notes])


def compose_verl(config_dir: str, items: list[str]):
    """verl's ``ppo_trainer`` config with ``items`` applied; SystemExit with Hydra's reason on one
    line when an override does not apply (a misspelt or unknown key, a value of the wrong type)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return compose("ppo_trainer", overrides=items)
    except (HydraException, OmegaConfBaseException) as exc:
        cause = f" ({str(exc.__cause__).splitlines()[0]})" if exc.__cause__ and str(exc.__cause__) else ""
        raise SystemExit(f"verl's config refused an override: {' '.join(str(exc).split())}{cause}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path, help="the recipe's YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a verl setting, or a recipe key (cluster., arctic., arctic_server.)")
    parser.add_argument("--dry-run", action="store_true", help="check the config and print the placement plan")
    args = parser.parse_args(argv)
    require_verl()
    recipe = load(args.recipe, args.set)
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(recipe)]
    if args.dry_run:
        print(dry_run(recipe))
        print("command:", " ".join(command))
        return 0
    return subprocess.run(command, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())

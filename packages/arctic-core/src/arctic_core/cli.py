"""The ``arctic-rl`` command line: the embedded demo, the HTTP server and the plugin listing."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from arctic_core.config import ArcticConfig

app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Arctic RL: one backend for RL post-training of LLMs (GPU engines; everything also runs on "
                       "the CPU).")
MAX_SEED = 2**32 - 1  # seeds the demo and tiny models take (numpy's range; the demo derives per-step seeds from it)
MAX_DEMO_STEPS = 1_000_000
_debug = False


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import version

        typer.echo(f"arctic-rl {version('arctic-core')}")
        raise typer.Exit()


@app.callback()
def _options(debug: Annotated[bool, typer.Option("--debug", help="Show the full traceback of an error (implies "
                                                                  "--verbose).")] = False,
             verbose: Annotated[bool, typer.Option("--verbose", help="Log at INFO and keep other libraries' start-up "
                                                                      "banners (also: ARCTIC_RL_VERBOSE=1).")] = False,
             version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                   help="Print the version and exit.")] = False) -> None:
    global _debug
    _debug = debug
    _set_verbosity(verbose or debug)


def _set_verbosity(verbose: bool) -> None:
    """Quiet by default: other libraries' banners about the missing GPU are dropped. Verbose goes
    into the environment, so that the processes this one starts (Ray workers) follow it."""
    from arctic_core.quiet import VERBOSE_ENV, hide_banners, verbose as env_verbose

    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    if env_verbose():
        logging.getLogger().setLevel(logging.INFO)
    hide_banners()


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Folder for TensorBoard logs, the reward plot and the checkpoint; an "
                                           "earlier demo run there is replaced.")] = Path("runs/demo"),
    steps: Annotated[int, typer.Option(min=1, max=MAX_DEMO_STEPS, help="GRPO steps.")] = 400,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Seed of the model, the task and sampling.")] = 0,
    warmup_steps: Annotated[int, typer.Option(min=0, help="Short SFT on task demonstrations before GRPO "
                                                          "(0 skips it).")] = 30,
    ahead: Annotated[int, typer.Option("--async", min=0, max=8, help="Rollouts run this many steps ahead of "
                                       "training (asynchronous RL; 0: synchronous).")] = 0,
) -> None:
    """GRPO on a tiny Qwen3 built in code, on the CPU, through the in-process client.

    Progress and every library's messages go to stderr; stdout is one JSON line, the summary."""
    with stdout_to_stderr():
        from arctic_core.demo.grpo import DemoSettings, run_demo

        _quiet_model_loading()
        with folder_errors(out):
            summary = run_demo(out, DemoSettings(steps=steps, seed=seed, warmup_steps=warmup_steps, ahead=ahead))
    typer.echo(f"reward curve: {out / 'reward_curve.png'}; TensorBoard: {out / 'tensorboard'}", err=True)
    typer.echo(json.dumps(summary))


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Folder to write (created; must be empty or absent).")],
    family: Annotated[str, typer.Option(help="Architecture: qwen3, qwen2, llama or mistral.")] = "qwen3",
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Seed of the random weights.")] = 0,
) -> None:
    """Write a tiny random model and its tokenizer (the demo's, 512 positions) as a Hugging Face
    folder: a model path to try the client and the server with, on the CPU, in seconds."""
    from arctic_core.demo.task import CountingTask
    from arctic_core.demo.tiny_model import TINY_SHAPES, save_tiny_policy
    from arctic_core.errors import ConfigError

    if family not in TINY_SHAPES:
        raise ConfigError(f"unknown family {family!r}; choose one of {sorted(TINY_SHAPES)}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a folder")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty")
    _quiet_model_loading()
    # Full attention, as Mistral's released configs since v0.2: the test shape's tiny window would
    # need the hf-generate sampler (the embedded engine refuses sliding-window layers).
    overrides = {"sliding_window": None} if family == "mistral" else {}
    with contextlib.redirect_stdout(sys.stderr), folder_errors(out):  # stdout: the folder alone (DeepSpeed logs there)
        save_tiny_policy(out, CountingTask().corpus(), family=family, seed=seed, **overrides)
    typer.echo(str(out))


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option(help="YAML ArcticConfig; without it the demo's tiny model is "
                                                     "served.")] = None,
    host: Annotated[str, typer.Option(help="Interface to bind; loopback unless you mean to expose the "
                                           "server.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: one the system picks, announced on "
                                                             "stderr).")] = 8000,
    max_body_mb: Annotated[float, typer.Option(min=0.001, help="Larger request bodies are answered 413.")] = 256,
    token: Annotated[str | None, typer.Option(envvar="ARCTIC_RL_TOKEN", show_envvar=True,
                                              help="Bearer token every call must carry.")] = None,
    allow_public_without_token: Annotated[bool, typer.Option("--allow-public-without-token",
                                                             help="Bind a non-loopback host with no token (anyone who "
                                                                  "can reach it can train your model).")] = False,
    ray: Annotated[bool, typer.Option("--ray", help="Run the trainer as data-parallel Ray workers and the sampler "
                                                    "as Ray replicas.")] = False,
    ray_workers: Annotated[int, typer.Option(min=1, help="Trainer ranks with --ray.")] = 2,
    ray_samplers: Annotated[int, typer.Option(min=0, help="Sampler replicas with --ray (0: the sampler stays in "
                                                          "the server process).")] = 1,
    address: Annotated[str | None, typer.Option(help="Ray cluster to join with --ray (default: start a local "
                                                     "one).")] = None,
) -> None:
    """Serve every client call over HTTP (FastAPI + uvicorn): generate calls side by side in the sampler's
    batch and beside training calls, which run one at a time."""
    from arctic_core.config import ArcticConfig  # torch and the engines wait until the config is sound

    token = token or None  # an empty ARCTIC_RL_TOKEN means none
    if not token and not is_loopback(host) and not allow_public_without_token:
        raise typer.BadParameter(
            f"refusing to serve on non-loopback host {host!r} without a token: set ARCTIC_RL_TOKEN (or --token), "
            "or pass --allow-public-without-token if the network is trusted",
            param_hint="--host",
        )
    if not ray and (ray_workers, ray_samplers, address) != (2, 1, None):
        raise typer.BadParameter("--ray-workers, --ray-samplers and --address take effect with --ray only",
                                 param_hint="--ray")
    arctic_config = ArcticConfig.from_yaml(config) if config else embedded_default_config()
    if ray:
        arctic_config = ray_config(arctic_config, ray_workers, ray_samplers, address)
    if token:
        from arctic_core.transports.http import check_token

        check_token(token, "--token / ARCTIC_RL_TOKEN")  # before the engines spend their start-up time
    with config_errors_from(config):
        arctic_config = arctic_config.with_local_models()
    # The port is taken before the engines spend minutes starting (a busy one is an error now, not
    # after), and listened on only once they serve: until then a health poll finds nothing here.
    listener = bind_port(host, port)
    with stdout_to_stderr():  # stdout stays empty: DeepSpeed's banners and uvicorn's access log are logs
        _serve(arctic_config, config, listener, token, max_body_mb)


def _serve(arctic_config: ArcticConfig, config: Path | None, listener: socket.socket, token: str | None,
           max_body_mb: float) -> None:
    with config_errors_from(config):
        import uvicorn

        from arctic_core.serving.http import create_app
        from arctic_core.serving.server import ArcticServer

        _quiet_model_loading()
        server = ArcticServer(arctic_config)
    # After a shutdown call the engines are gone: exit once it is answered, freeing the port and the
    # memory.
    app_ = create_app(server, token=token, max_body_bytes=int(max_body_mb * 2**20),
                      on_shutdown=lambda: setattr(http_server, "should_exit", True))
    http_server = uvicorn.Server(uvicorn.Config(app_, log_level="info"))
    host, port = listener.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"  # the bound port, also for --port 0
    typer.echo(f"Arctic RL serving on {url} (API: /openapi.json, /docs; token {'required' if token else 'off'})",
               err=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C stops the server cleanly, as in uvicorn.run
        http_server.run(sockets=[listener])
    if not http_server.started:  # uvicorn could not start; it has logged why
        raise SystemExit(3)


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening); a taken port is an ArcticError."""
    from arctic_core.errors import ArcticError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ArcticError(f"--host: {host!r} is no address of this machine: {exc.strerror}") from None
    # proto=IPPROTO_TCP as asyncio's own server sockets: only then does asyncio set TCP_NODELAY.
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        listener.bind(address)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ArcticError(f"--host: cannot serve on {host}: {exc.strerror} (not an address of this machine; "
                              "0.0.0.0 binds them all)") from None
        raise ArcticError(f"--port: cannot serve on {host}:{port}: {exc.strerror} (another server there? choose "
                          "another --port)") from None
    return listener


def ray_config(config: ArcticConfig, workers: int, samplers: int, address: str | None) -> ArcticConfig:
    """``serve --ray``: the trainer as data-parallel Ray ranks, the sampler as Ray replicas, and
    weights broadcast from rank 0 to the replicas when the config left the in-process copy."""
    from arctic_core.ray.sampler import ray_sampler_config
    from arctic_core.ray.trainer import ray_trainer_config

    update: dict[str, object] = {"trainer": ray_trainer_config(config.trainer, workers, address)}
    if samplers:
        update["sampler"] = ray_sampler_config(config.sampler, samplers, address)
        if config.weight_sync.transport == "inprocess":
            update["weight_sync"] = config.weight_sync.model_copy(update={"transport": "torch-broadcast"})
    return config.model_copy(update=update)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name: it may resolve anywhere
        return False


def embedded_default_config() -> ArcticConfig:
    """The demo's tiny Qwen3 (built once into a cache folder) with a reference engine, on the CPU."""
    from arctic_core.config import ArcticConfig, LogProbConfig, ModelConfig
    from arctic_core.demo.task import CountingTask
    from arctic_core.demo.tiny_model import save_tiny_policy

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "arctic-rl" / "tiny-policy"
    if not (cache / "config.json").is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".tiny-policy-"))
        save_tiny_policy(staging, CountingTask().corpus(), seed=0)
        try:
            os.replace(staging, cache)  # two servers starting at once: the first rename wins
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return ArcticConfig(model=ModelConfig(path=str(cache), device="cpu"), reference=LogProbConfig())


@app.command("config-reference")
def config_reference(
    builtin: Annotated[bool, typer.Option("--builtin",
                                          help="Only Arctic's own plugins (the page in the docs).")] = False,
) -> None:
    """Print the configuration reference (Markdown): every key of the config, the sampling params,
    and the options of every installed backend and loss term."""
    from arctic_core.config_docs import BUILTIN_PLUGINS, config_reference as render
    from arctic_core.plugins.registry import default_registry

    typer.echo(render(default_registry(), BUILTIN_PLUGINS if builtin else None), nl=False)


@app.command()
def plugins() -> None:
    """List every registered plugin and what it provides."""
    from arctic_core.plugins.registry import default_registry

    registry = default_registry()
    table = Table(title="Arctic plugins (entry-point group 'arctic')")
    for column in ("plugin", "kind", "name", "what"):
        table.add_column(column)
    for item in sorted(registry.all(), key=lambda p: (p.plugin, p.kind, p.name)):
        missing = item.missing()
        what = escape(item.summary) + (f" [red](needs {escape(missing)})[/red]" if missing else "")
        table.add_row(item.plugin, item.kind.replace("_", " "), item.name, what)
    Console(width=160).print(table)


@contextlib.contextmanager
def folder_errors(out: Path) -> Iterator[None]:
    """A folder that cannot be created or written (a path under /proc, no permission, a full disk)
    as one error line naming it, not an OSError's traceback."""
    from arctic_core.errors import ConfigError

    try:
        yield
    except OSError as exc:
        if exc.filename is None or not Path(exc.filename).resolve().is_relative_to(out.resolve()):
            raise  # not the folder's: a bug, with its traceback
        raise ConfigError(f"cannot write {exc.filename}: {exc.strerror}") from exc


@contextlib.contextmanager
def config_errors_from(path: Path | None) -> Iterator[None]:
    """A config error raised inside (e.g. a backend refusing its ``options``) names the file."""
    from arctic_core.errors import ConfigError

    try:
        yield
    except ConfigError as exc:
        if path is None:
            raise
        raise ConfigError(f"config {path}: {exc}") from exc


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to file descriptor 1 inside the block to stderr: print(), logging
    handlers that hold sys.stdout, and C extensions alike (DeepSpeed's banners, compiler output)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _quiet_model_loading() -> None:
    """No "Loading weights" bar for each engine that loads the model (several per server)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


GLOBAL_FLAGS = ("--debug", "--verbose")


def _global_flags_first(args: list[str]) -> list[str]:
    """``--debug`` and ``--verbose`` are options of ``arctic-rl`` itself, but are as often typed
    after the subcommand (``arctic-rl serve config.yaml --debug``): moved to the front, they work in
    either place."""
    end = args.index("--") if "--" in args else len(args)
    flags = [flag for flag in GLOBAL_FLAGS if flag in args[:end]]
    if not flags:
        return args
    rest = [arg for arg in args[:end] if arg not in GLOBAL_FLAGS]
    return [*flags, *rest, *args[end:]]


def main() -> None:
    """The console script: an Arctic error (bad config, bad input) is one line on stderr and exit
    status 2; ``--debug`` shows its traceback. Anything else is a bug and keeps its traceback."""
    from arctic_core.errors import ArcticError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app(args=_global_flags_first(sys.argv[1:]))
    except ArcticError as exc:
        if _debug:
            raise
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()

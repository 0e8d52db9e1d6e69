"""The ``arctic-primerl`` command.

    arctic-primerl rl @ rl.toml        # PRIME-RL's orchestrator, trained and served by Arctic
    arctic-primerl rl @ rl.toml --dry-run

Bad settings, a missing PRIME-RL command, a model folder that does not exist or a port in use end
the command in seconds with one line naming the problem (exit status 2); so does a server on
``[arctic] url`` that goes away mid-run, once PRIME-RL's processes are stopped.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from arctic_core.adapters.lost_server import end_if_server_lost
from arctic_core.adapters.preflight import exit_with
from arctic_core.errors import ArcticError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
NAME = "arctic-primerl"
RERUN = "rerun with a [resume] table in the config to continue from the last checkpoint"


@app.callback()
def _main() -> None:
    """PRIME-RL on the Arctic RL backend."""


@app.command()
def rl(
    config: Annotated[list[str], typer.Argument(help="@ rl.toml: PRIME-RL's rl config, with an \\[arctic] table.")],
    dry_run: Annotated[bool, typer.Option(help="Check the settings and print the commands; "
                                               "start and write nothing.")] = False,
) -> None:
    """Run PRIME-RL's orchestrator and environment servers; Arctic trains and samples."""
    from arctic_primerl.config import read_run
    from arctic_primerl.launch import preflight

    paths = [c for c in config if c != "@"]
    if len(paths) != 1:
        exit_with(NAME, "give one config: arctic-primerl rl @ rl.toml")
    launch_env = dict(os.environ)  # PRIME-RL's processes get theirs on top of this, not this process's
    try:
        run = read_run(Path(paths[0]))
        os.environ.update(run.backend_env)  # before torch meets the GPUs and the checks fetch a model
        token, processes = preflight(run)
    except (ArcticError, OSError) as exc:
        exit_with(NAME, str(exc))
    if dry_run:
        for process in processes:
            typer.echo(" ".join(process.command))
        return
    _run(run, processes, token, {**launch_env, **run.process_env})


def _run(run, processes, token, process_env: dict[str, str]) -> None:
    import torch

    from arctic_primerl.launch import Watchdog
    from arctic_primerl.service import ArcticPrimeRL

    try:
        service = ArcticPrimeRL(run, on_gpu=torch.cuda.is_available())
    except ArcticError as exc:  # e.g. a run folder holding an earlier run's steps
        exit_with(NAME, str(exc))
    try:
        url = service.start_front(token)
    except OSError as exc:
        service.stop()
        exit_with(NAME, f"cannot serve on {run.arctic.host}:{run.port}: {exc}")
    typer.echo(f"{NAME}: serving PRIME-RL's inference routes at {url}; logs under {run.run_dir / 'logs'}", err=True)
    # SIGTERM ends the run as Ctrl-C does: through the finally below, which stops PRIME-RL's processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    watchdog = Watchdog(processes, service.trainer.settings.stop, lambda: service.trainer.awaited)
    try:
        _train(service, processes, process_env, watchdog)
    except Exception:
        end_if_server_lost(NAME, run.arctic, RERUN)  # a server on [arctic] url that went away is named last
        raise
    if watchdog.reason:
        end_if_server_lost(NAME, run.arctic, RERUN, failure=f"{NAME}: {watchdog.reason}")
        exit_with(NAME, watchdog.reason)


def _train(service, processes, process_env: dict[str, str], watchdog) -> None:
    """Start PRIME-RL's processes and train until the last step or the watchdog's stop; the
    processes and the service are stopped however it ends."""
    from arctic_primerl.launch import EXIT_WAIT_S

    try:
        for process in processes:
            process.start(process_env)
        watchdog.start()
        service.train()
        if not watchdog.reason:
            processes[-1].popen.wait(timeout=EXIT_WAIT_S)  # the orchestrator drains and exits after its last step
    finally:
        for process in processes:
            process.stop()
        service.stop()


def main() -> None:
    app()


if __name__ == "__main__":
    main()

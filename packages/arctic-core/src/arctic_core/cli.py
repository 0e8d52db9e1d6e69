"""The ``arctic-rl`` command line: the embedded demo and the plugin listing."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False, help="Arctic RL: one GPU backend for RL post-training of LLMs.")


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Folder for TensorBoard logs, the reward plot and the checkpoint.")] = Path("runs/demo"),
    steps: Annotated[int, typer.Option(min=1, help="GRPO steps.")] = 400,
    seed: Annotated[int, typer.Option(help="Seed of the model, the task and sampling.")] = 0,
    warmup_steps: Annotated[int, typer.Option(min=0, help="Short SFT on task demonstrations before GRPO (0 skips it).")] = 30,
) -> None:
    """GRPO on a tiny Qwen3 built in code, on the CPU, through the in-process client."""
    from arctic_core.demo.grpo import DemoSettings, run_demo

    summary = run_demo(out, DemoSettings(steps=steps, seed=seed, warmup_steps=warmup_steps))
    typer.echo(f"reward curve: {out / 'reward_curve.png'}; TensorBoard: {out / 'tensorboard'}", err=True)
    typer.echo(json.dumps(summary))


@app.command()
def plugins() -> None:
    """List every registered plugin and what it provides."""
    from arctic_core.registry import default_registry

    registry = default_registry()
    table = Table(title="Arctic plugins (entry-point group 'arctic')")
    for column in ("plugin", "kind", "name", "what"):
        table.add_column(column)
    for item in sorted(registry.all(), key=lambda p: (p.plugin, p.kind, p.name)):
        table.add_row(item.plugin, item.kind.replace("_", " "), item.name, item.summary)
    Console(width=160).print(table)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()

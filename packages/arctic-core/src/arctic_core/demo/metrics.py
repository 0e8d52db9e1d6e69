"""Metric sinks of the demo: TensorBoard event files and a PNG of the reward curve."""

from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter


class MetricsLogger:
    """Writes scalars as TensorBoard events under ``{phase}/{name}``."""

    def __init__(self, log_dir: Path) -> None:
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, phase: str, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(f"{phase}/{name}", value, step)

    def close(self) -> None:
        self.writer.close()


def plot_rewards(rewards: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on our machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(rewards) + 1), rewards, marker=".", label="mean reward")
    ax.set(xlabel="GRPO step", ylabel="reward", title="Arctic RL demo: counting task", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

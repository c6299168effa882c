"""``reward_curve.png``: train and validation reward per step."""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)


def plot_reward_curve(
    path: str, train: Sequence[tuple[int, float | None]], val: Sequence[tuple[int, float | None]]
) -> str | None:
    """Draw the curves into ``path``; returns it, or None when there is no point to draw."""
    train_points = [(s, v) for s, v in train if v is not None]
    val_points = [(s, v) for s, v in val if v is not None]
    if not train_points and not val_points:
        return None
    # A figure on its own Agg canvas, not pyplot: nothing global changes (the process's backend, pyplot's
    # list of open figures), and pyplot's import is skipped (~0.15 s of the start-up budget).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if train_points:
        steps, values = zip(*train_points, strict=True)
        ax.plot(steps, values, label="train reward (mean)", color="tab:blue")
    if val_points:
        steps, values = zip(*val_points, strict=True)
        ax.plot(
            steps,
            values,
            label="validation reward",
            color="tab:orange",
            marker="o",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path

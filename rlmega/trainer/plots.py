"""The reward-curve PNG of a run: training score per step, validation metrics per validation step.

matplotlib is used through its object API with the Agg canvas, so writing the PNG neither needs a
display nor changes the pyplot backend of the process that hosts the trainer.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

Series = Sequence[tuple[int, float]]
"""(step, value) points in step order."""

MAX_VAL_LINES = 8
"""Validation metrics drawn at most; the rest stay in metrics.jsonl."""


def matplotlib_available() -> bool:
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


def pick_val_series(val_series: Mapping[str, Series]) -> dict[str, Series]:
    """The validation metrics worth a line: names with acc/score/reward (all of them if none match), at most 8."""
    wanted = {k: v for k, v in val_series.items() if any(w in k.lower() for w in ("acc", "score", "reward"))}
    return dict(list((wanted or dict(val_series)).items())[:MAX_VAL_LINES])


def plot_reward_curve(
    path: str | os.PathLike,
    train_score: Series,
    val_series: Mapping[str, Series],
    response_length: Series = (),
    title: str = "",
) -> None:
    """Write the curve to ``path`` (replaced atomically, so a viewer never reads half a file).

    Top panel: ``train_score`` as a line and each picked validation series as markers on one axis.
    Bottom panel (only when ``response_length`` has points): mean response length per step.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    val_lines = pick_val_series(val_series)
    num_panels = 2 if response_length else 1
    fig = Figure(figsize=(8, 3.2 * num_panels + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(num_panels, 1, sharex=True, squeeze=False)[:, 0]

    reward_ax = axes[0]
    if train_score:
        steps, values = zip(*train_score)
        reward_ax.plot(steps, values, label="train score (critic/score/mean)", color="C0", linewidth=1.2)
    for index, (name, points) in enumerate(val_lines.items(), 1):
        if points:
            steps, values = zip(*points)
            reward_ax.plot(steps, values, marker="o", markersize=4, linewidth=1, label=name, color=f"C{index}")
    reward_ax.set_ylabel("score / accuracy")
    reward_ax.grid(alpha=0.3)
    if train_score or any(val_lines.values()):
        reward_ax.legend(loc="best", fontsize="small")
    if title:
        reward_ax.set_title(title)

    if response_length:
        steps, values = zip(*response_length)
        axes[1].plot(steps, values, color="tab:gray", linewidth=1.2)
        axes[1].set_ylabel("response length (mean)")
        axes[1].grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=110)
    os.replace(tmp, path)

"""The refit each recipe's planner predicts: through trainer rank 0 (the recipe's transport) and sliced (the
transfer plan, every training rank sending what it owns to the engine ranks that hold it).

    python benchmarks/refit_plan.py                       # the four recipes under configs/recipes
    python benchmarks/refit_plan.py configs/recipes/qwen3_8b/grpo.yaml sync.transport=sharded_rdt

For each recipe, in one run: the transport's predicted refit (``rlmega.plan.refit``), the sliced plan's bytes per
link kind, its slowest GPU and what bounds it, its predicted seconds (``rlmega.plan.sliced_refit``), the time to
make the transfer plan (``rlmega.bridge.layout_pieces`` + ``rlmega.sync.transfer_plan``, summed), and the whole
``make_plan``. Predictions only: what a transport measures against the plan comes with the transport.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _row(cells: list[str], widths: list[int]) -> str:
    return "".join(f"{cell:<{width}}" if i == 0 else f"{cell:>{width}}"
                   for i, (cell, width) in enumerate(zip(cells, widths)))


def main(argv: list[str]) -> None:
    from rlmega.config import load_config
    from rlmega.plan import make_plan

    recipes = [arg for arg in argv if "=" not in arg] or sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "configs" / "recipes").glob("*/*.yaml"))
    overrides = [arg for arg in argv if "=" in arg]
    widths = [18, 15, 8, 11, 10, 10, 9, 22, 8, 8, 8]
    print(_row(["recipe", "transport", "s", "sliced s", "net GB", "NVL GB", "GPU GB", "slowest GPU, bound",
                "msgs k", "plan s", "all s"], widths))
    for recipe in recipes:
        started = time.perf_counter()
        plan = make_plan(load_config(recipe, overrides=overrides, check=False), recipe)
        elapsed = time.perf_counter() - started
        refit = plan.refit
        sliced = refit.sliced or refit.target
        name = Path(recipe).parent.name
        if sliced is None:
            print(_row([name, refit.transport, f"{refit.seconds_overlapped:.2f}", "-"], widths[:4]))
            continue
        print(_row([name, refit.transport, f"{refit.seconds_overlapped:.2f}", f"{sliced.seconds:.2f}",
                    f"{sliced.link_bytes['network'] / 1e9:.1f}", f"{sliced.link_bytes['nvlink'] / 1e9:.1f}",
                    f"{sliced.link_bytes['self'] / 1e9:.1f}", f"{sliced.slowest.gpu}, {sliced.slowest.bound}",
                    f"{sum(sliced.link_messages.values()) / 1e3:.0f}", f"{sliced.plan_seconds:.1f}",
                    f"{elapsed:.1f}"], widths))


if __name__ == "__main__":
    import os

    os.chdir(ROOT)  # the recipes name their config.json relative to the checkout
    main(sys.argv[1:])

"""The refit each recipe's planner predicts: through trainer rank 0 (the recipe's transport) and sliced (the
transfer plan, every training rank sending what it owns to the engine ranks that hold it).

    python benchmarks/refit_plan.py                       # the four recipes under configs/recipes
    python benchmarks/refit_plan.py configs/recipes/qwen3_8b/grpo.yaml sync.transport=sharded_rdt
    python benchmarks/refit_plan.py --emulate             # the sliced transport run on CPU, bytes per link vs plan

For each recipe, in one run: the transport's predicted refit (``rlmega.plan.refit``), the sliced plan's bytes per
link kind, its slowest GPU and what bounds it, its predicted seconds (``rlmega.plan.sliced_refit``), the time to
make the transfer plan (``rlmega.bridge.layout_pieces`` + ``rlmega.sync.transfer_plan``, summed), and the whole
``make_plan``.

``--emulate`` runs the ``sliced`` transport for real on this machine (``rlmega.sync.sliced_emulation``, gloo): 8
training ranks of a small random Qwen3-MoE (TP2 x PP2 x EP2) feed 4 engine-rank processes (two engines of TP2, every
expert split in two, colocated on nodes of two GPUs), and prints per link kind the bytes the ranks sent and received
against the plan's, whether every engine rank ends bit-identical to the checkpoint, and the update's wall time.
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


def emulate() -> None:
    import tempfile

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from rlmega.parallel.layout import ParallelLayout
    from rlmega.rollout.engine_bytes import EngineLayout
    from rlmega.sync.sliced_emulation import Emulation, emulate as run
    from rlmega.sync.transfer_plan import LINKS

    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        config = Qwen3MoeConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=128, max_position_embeddings=128)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        emulation = Emulation(directory, ParallelLayout(tp=2, pp=2, ep=2, world_size=8),
                              EngineLayout(tensor_parallel_size=2, dtype_bytes=4), num_engines=2, gpus_per_node=2,
                              colocated=True, bucket_bytes=4 * 1024**2, updates=2, timeout_s=600)
        report = run(emulation)
        checkpoint = load_file(next(Path(directory).glob("*.safetensors")))
        traffic = report.plan.traffic
        print(f"{'link':<10}{'plan sent':>14}{'measured sent':>16}{'plan received':>16}{'measured received':>20}")
        for update in range(emulation.updates):
            sent, received = report.measured(update)
            for index, link in enumerate(LINKS):
                print(f"{link:<10}{traffic.sent_bytes[:, index].sum():>14,}{sent[:, index].sum():>16,}"
                      f"{traffic.received_bytes[:, index].sum():>16,}{received[:, index].sum():>20,}")
            same = (sent == traffic.sent_bytes).all() and (received == traffic.received_bytes).all()
            wrong = report.mismatches(update, checkpoint)
            print(f"update {update + 1}: every rank's bytes per link equal the plan's: {bool(same)}; engine ranks "
                  f"bit-identical: {not wrong}; {report.seconds[update]:.2f} s, {traffic.total_bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    import os

    os.chdir(ROOT)  # the recipes name their config.json relative to the checkout
    emulate() if sys.argv[1:] == ["--emulate"] else main(sys.argv[1:])

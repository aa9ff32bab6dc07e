"""``rlmega smoke``: the smallest real thing, end to end on this machine.

Trains the tiny Megatron GPT on a counting task with Megatron-Core's own schedule, DDP and optimizer,
on gloo ranks started here (on the CPU, also on a GPU node) in the parallel layout you ask for, and
prints the loss live. The loss starts near ln(1024) ≈ 6.93 (a uniform guess over the vocabulary) and
falls as the model learns to count.
"""

from __future__ import annotations

import argparse
import math
import time

HELP = "check Megatron-Core training on this machine: a tiny GPT learns to count in any parallel layout (no RL)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default: 60)")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel degree (default: 2)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel degree (default: 1)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual stages per pipeline rank (needs --pp > 1)")
    parser.add_argument("--dp", type=int, default=1, help="data parallel degree (default: 1)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default: 3e-3)")
    parser.add_argument(
        "--micro-batches", type=int, default=4, help="micro-batches per step, split over dp (default: 4)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is stopped (default: 600)")


def _train(rank: int, world_size: int, layout, steps: int, lr: float, num_microbatches: int):
    from megatron.core import parallel_state
    from rich.console import Console

    from rlmega.parallel.layout import destroy, initialize
    from rlmega.models import tiny_gpt

    initialize(layout)
    chunks = tiny_gpt.build_model(tiny_gpt.TinyGPTSpec(), layout)
    optimizer = tiny_gpt.build_optimizer(chunks, lr=lr)
    # The rank that reports: last pipeline stage, first of its tensor and data-parallel groups.
    reports = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    console = Console(highlight=False, soft_wrap=True)  # one line per step, also in logs
    if reports:
        console.print(f"[bold]rlmega smoke[/]  {layout.describe()}  tiny GPT, {steps} steps")
    losses = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        batches = tiny_gpt.make_counting_batches(num_microbatches, 8, seed=step)[dp_rank::dp]
        loss, grad_norm = tiny_gpt.train_step(chunks, optimizer, batches)
        if reports:
            losses.append(loss)
            elapsed = time.perf_counter() - started
            bar = "█" * round(20 * step / steps)
            console.print(
                f"step {step:>4}/{steps} {bar:<20} loss {loss:.4f}  grad_norm {grad_norm:.3f}  "
                f"{elapsed / step:.3f} s/step"
            )
    destroy()
    return losses


def run(args: argparse.Namespace) -> int:
    from rlmega.parallel.layout import LayoutError, ParallelLayout
    from rlmega.parallel.spawn import RankFailure, run_on_ranks
    from rlmega.models.tiny_gpt import VOCAB_SIZE, TinyGPTSpec

    try:
        layout = ParallelLayout(
            tp=args.tp, pp=args.pp, vpp=args.vpp, world_size=args.tp * args.pp * args.dp
        )
        TinyGPTSpec().check_layout(layout)
    except LayoutError as error:
        print(f"rlmega smoke: {error}")
        return 2
    if args.micro_batches % args.dp or args.steps < 1:
        print(
            f"rlmega smoke: --micro-batches {args.micro_batches} must be divisible by "
            f"--dp {args.dp}, and --steps {args.steps} must be positive"
        )
        return 2
    try:
        results = run_on_ranks(
            _train, layout.world_size, timeout_s=args.timeout, cpu_only=True,
            args=(layout, args.steps, args.lr, args.micro_batches),
        )
    except RankFailure as failure:
        print(f"rlmega smoke: {failure}")
        return 1
    [losses] = [r for r in results if r]
    first, last = losses[0], losses[-1]
    print(f"loss {first:.3f} -> {last:.3f} over {len(losses)} steps (uniform guess: {math.log(VOCAB_SIZE):.3f})")
    if not last < first:
        print("rlmega smoke: the loss did not fall; training is broken on this machine")
        return 1
    return 0

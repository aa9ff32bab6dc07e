"""What context parallelism buys on one long sequence: peak activation memory per rank and the time
of one actor update at cp=1 (one rank) vs cp=2 (two gloo ranks), side by side in one run.

    python benchmarks/context_parallel.py                  # one 6144-token sequence (~3-4 min on 2 cores)
    python benchmarks/context_parallel.py --tokens 8192    # ~6 min, cp=1 needs ~15 GiB
    python benchmarks/context_parallel.py --tokens 2048    # quick

A random Llama-shaped HF checkpoint (4 layers, hidden 256, 8 query / 4 key-value heads, vocabulary
1024) is written to a temporary directory; both configurations load it. Each configuration runs in
fresh spawned processes: every rank builds an actor worker, computes the old log-probs of the same
sequence once (warm-up, not measured), then measures one ``compute_logprobs`` (forward only) and
one ``update`` (forward, backward and Adam step). A sampler thread reads the rank's resident memory
every millisecond; the reported peak is the rise above the resident memory just before the call,
so it is the activations and temporaries (plus, for the update, Adam's state, created on the first
step: under 50 MiB for this model). At cp=2 each rank holds half of the sequence (zigzag split) and
its attention scores are [S/2, S] instead of [S, S].

Without transformer-engine rlmega attends with ``rlmega.models.core_attention.TorchCoreAttention``
(torch's fused ``scaled_dot_product_attention``; under CP after an all-gather of keys and values).
cp=1 also runs with Megatron's local ``DotProductAttention`` forced ("cp=1 megatron-local"), the
attention Megatron's local spec would use: it materialises every [S, S] score matrix (and keeps a
persistent buffer of that size as ``baddbmm``'s input), so the row shows what the fused kernel saves.

Each rank runs with --threads compute threads (default 1), so cp=2 does the same arithmetic as
cp=1 on twice the threads, split over two processes, plus the key/value all-gathers. As a sanity
check the loss and gradient norm of the updates must agree (all did the same work).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import threading
import time

MIB = 1024**2
PROMPT_TOKENS = 64
# name: (cp, force Megatron's local DotProductAttention)
CONFIGS = {"cp=1 megatron-local": (1, True), "cp=1": (1, False), "cp=2": (2, False)}


class PeakRSS:
    """Peak resident memory of this process above its level on entry, sampled every millisecond."""

    def __init__(self):
        import psutil

        self._process = psutil.Process()
        self._stop = threading.Event()

    def _sample(self):
        while not self._stop.is_set():
            self._peak = max(self._peak, self._process.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self):
        gc.collect()  # leftovers of earlier calls must not count in the baseline's favour
        self._baseline = self._peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._started
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._process.memory_info().rss)
        self.mib = (self._peak - self._baseline) / MIB
        self.total_mib = self._peak / MIB


def _save_model(directory: str, tokens: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max(16384, tokens))
    AutoModelForCausalLM.from_config(config).float().save_pretrained(directory)


def _force_megatron_attention() -> None:
    """Make this process build Megatron's local ``DotProductAttention`` instead of rlmega's."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from rlmega.models.spec import ModelSpec

    layer_spec = ModelSpec.layer_spec

    def with_megatron_attention(self, *, dense=False):
        spec = layer_spec(self, dense=dense)
        spec.submodules.self_attention.submodules.core_attention = DotProductAttention
        return spec

    ModelSpec.layer_spec = with_megatron_attention


def _rank_body(rank, world_size, cp, megatron_attention, hf_dir, tokens):
    import torch

    from rlmega.models import model_spec_from_hf
    from rlmega.parallel.layout import ParallelLayout, destroy, initialize
    from rlmega.workers.batching import SequenceBatch
    from rlmega.workers.config import BatchingConfig, OptimizerConfig, PolicyLossConfig, WorkerConfig
    from rlmega.workers.worker import MegatronWorker

    if megatron_attention:
        _force_megatron_attention()
    layout = ParallelLayout(cp=cp, world_size=world_size)
    initialize(layout)
    config = WorkerConfig(
        role="actor",
        optimizer=OptimizerConfig(lr=1e-5, lr_schedule="constant"),
        # One micro-batch holds the whole sequence, so the peak is that of the full sequence.
        batching=BatchingConfig(max_tokens_per_microbatch=1 << 20),
        policy_loss=PolicyLossConfig(name="ppo"),
    )
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    generator = torch.Generator().manual_seed(1)  # same sequence and advantages on every rank
    batch = SequenceBatch([torch.randint(0, 1024, (tokens,), generator=generator)], [PROMPT_TOKENS])
    advantages = [torch.randn(tokens - PROMPT_TOKENS, generator=generator)]

    old_logp, _ = worker.compute_logprobs(batch)  # warm-up: first-call allocations and lazy setup
    with PeakRSS() as forward:
        worker.compute_logprobs(batch)
    with PeakRSS() as update:
        metrics = worker.update(batch.with_fields(old_logp=old_logp, advantages=advantages))
    destroy()
    return dict(forward_mib=forward.mib, forward_s=forward.seconds, update_mib=update.mib,
                update_s=update.seconds, total_mib=max(forward.total_mib, update.total_mib),
                pg_loss=metrics["actor/pg_loss"], grad_norm=metrics["actor/grad_norm"])


def _close(a: float, b: float, rel: float = 1e-4) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=6144,
                        help=f"length of the one sequence ({PROMPT_TOKENS} prompt tokens, the rest response; "
                             "a multiple of 4 so cp=2 needs no padding); default 6144")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads per rank (default 1)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per configuration")
    parser.add_argument("--json", action="store_true", help="also print the per-rank results as JSON")
    args = parser.parse_args()

    from rlmega.parallel.spawn import run_on_ranks

    # Spawned ranks inherit these (fresh processes: glibc reads its settings at start). A fixed mmap threshold
    # returns freed large blocks to the OS at once, so RSS follows live memory and the baselines are not
    # inflated by cached heap.
    os.environ.update(OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_=str(MIB))
    results = {}
    with tempfile.TemporaryDirectory() as hf_dir:
        _save_model(hf_dir, args.tokens)
        for name, (cp, megatron_attention) in CONFIGS.items():
            results[name] = run_on_ranks(_rank_body, cp, timeout_s=args.timeout, start_method="spawn",
                                         args=(cp, megatron_attention, hf_dir, args.tokens))
    if args.json:
        print(json.dumps(results, indent=1))

    # Memory and time: the worst rank. Loss and gradient norm are the same on every rank: rank 0's.
    measured = ("forward_mib", "forward_s", "update_mib", "update_s", "total_mib")
    rows = {name: {**ranks[0], **{key: max(rank[key] for rank in ranks) for key in measured}}
            for name, ranks in results.items()}
    print(f"one sequence of {args.tokens} tokens ({PROMPT_TOKENS} prompt), {args.threads} thread(s) per rank; "
          "MiB: peak RSS above the call's start (total: peak RSS), worst rank; s: slowest rank")
    header = f"{'config':<19}{'ranks':>6}{'forward MiB':>13}{'forward s':>11}{'update MiB':>12}{'update s':>10}{'total MiB':>11}"
    print(header)
    for name, row in rows.items():
        print(f"{name:<19}{CONFIGS[name][0]:>6}" + "".join(f"{row[key]:>{width}.{digits}f}" for key, width, digits in
                                                           zip(measured, (13, 11, 12, 10, 11), (0, 2, 0, 2, 0))))
    cp2 = rows["cp=2"]
    for base in ("cp=1", "cp=1 megatron-local"):
        print(f"{'cp=2 / ' + base:<25}" + "".join(f"{cp2[key] / rows[base][key]:>{width}.2f}" for key, width in
                                                 zip(measured, (13, 11, 12, 10, 11))))
    reference = rows["cp=1"]
    same = all(_close(row[key], reference[key]) for row in rows.values() for key in ("pg_loss", "grad_norm"))
    print("pg_loss " + ", ".join(f"{name} {row['pg_loss']:.6g}" for name, row in rows.items()) + "; grad_norm "
          + ", ".join(f"{name} {row['grad_norm']:.6g}" for name, row in rows.items())
          + f": {'match' if same else 'MISMATCH'} (rel 1e-4)")
    if not same:
        raise SystemExit("the configurations' updates disagree")


if __name__ == "__main__":
    main()

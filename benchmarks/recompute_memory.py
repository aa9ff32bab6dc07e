"""What activation recomputation saves: peak memory and time of one actor update on one long
sequence without recomputation, with selective (core attention + MLP) and with full recomputation,
side by side in one run, each in a fresh process.

    python benchmarks/recompute_memory.py                  # one 4096-token sequence, 8 layers (~2 min on 2 cores)
    python benchmarks/recompute_memory.py --tokens 8192

The model is the random Llama of ``context_parallel.py`` with --layers layers; memory is sampled the
same way (peak resident memory above the call's start, see ``PeakRSS`` there). Full recomputation
keeps only each layer's input and recomputes the layer in the backward pass, so activation memory
no longer grows with the number of layers, at the cost of one more forward pass. The loss and
gradient norm of the three updates must agree (recomputation changes memory, not arithmetic).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from context_parallel import MIB, PROMPT_TOKENS, PeakRSS, _close

CONFIGS = {
    "none": {},
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    "full": dict(recompute_granularity="full"),
}


def _save_model(directory: str, tokens: int, layers: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max(16384, tokens))
    AutoModelForCausalLM.from_config(config).float().save_pretrained(directory)


def _rank_body(rank, world_size, memory, hf_dir, tokens):
    import torch

    from rlmega.models import model_spec_from_hf
    from rlmega.parallel.layout import ParallelLayout, destroy, initialize
    from rlmega.workers.batching import SequenceBatch
    from rlmega.workers.config import BatchingConfig, OptimizerConfig, PolicyLossConfig, WorkerConfig
    from rlmega.workers.worker import MegatronWorker

    layout = ParallelLayout()
    initialize(layout)
    config = WorkerConfig(role="actor", optimizer=OptimizerConfig(lr=1e-5), policy_loss=PolicyLossConfig(name="ppo"),
                          batching=BatchingConfig(max_tokens_per_microbatch=1 << 20), **memory)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    generator = torch.Generator().manual_seed(1)
    batch = SequenceBatch([torch.randint(0, 1024, (tokens,), generator=generator)], [PROMPT_TOKENS])
    advantages = [torch.randn(tokens - PROMPT_TOKENS, generator=generator)]
    old_logp, _ = worker.compute_logprobs(batch)
    worker.update(batch.with_fields(old_logp=old_logp, advantages=advantages))  # warm-up: Adam's state appears
    with PeakRSS() as update:
        metrics = worker.update(batch.with_fields(old_logp=old_logp, advantages=advantages))
    destroy()
    return dict(update_mib=update.mib, update_s=update.seconds, total_mib=update.total_mib,
                pg_loss=metrics["actor/pg_loss"], grad_norm=metrics["actor/grad_norm"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="length of the one sequence (default 4096)")
    parser.add_argument("--layers", type=int, default=8, help="transformer layers of the model (default 8)")
    parser.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads (default 2)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per configuration")
    args = parser.parse_args()

    from rlmega.parallel.spawn import run_on_ranks

    os.environ.update(OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_=str(MIB))
    with tempfile.TemporaryDirectory() as hf_dir:
        _save_model(hf_dir, args.tokens, args.layers)
        rows = {name: run_on_ranks(_rank_body, 1, timeout_s=args.timeout, args=(memory, hf_dir, args.tokens),
                                 start_method="spawn")[0]
                for name, memory in CONFIGS.items()}
    print(f"one update on one sequence of {args.tokens} tokens, {args.layers}-layer Llama (hidden 256), fp32, "
          f"{args.threads} thread(s); MiB: peak RSS above the call's start (total: peak RSS)")
    print(f"{'recompute':<12}{'update MiB':>12}{'update s':>10}{'total MiB':>11}{'MiB / none':>12}{'s / none':>10}")
    base = rows["none"]
    for name, row in rows.items():
        print(f"{name:<12}{row['update_mib']:>12.0f}{row['update_s']:>10.2f}{row['total_mib']:>11.0f}"
              f"{row['update_mib'] / base['update_mib']:>12.2f}{row['update_s'] / base['update_s']:>10.2f}")
    same = all(_close(row[key], base[key], rel=1e-5) for row in rows.values() for key in ("pg_loss", "grad_norm"))
    print("grad_norm " + ", ".join(f"{name} {row['grad_norm']:.7g}" for name, row in rows.items())
          + f": {'match' if same else 'MISMATCH'} (rel 1e-5)")
    if not same:
        raise SystemExit("recomputation changed the update")


if __name__ == "__main__":
    main()

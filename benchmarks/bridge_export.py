"""Streaming HF export throughput, side by side with the machine's own limits, in one run.

    python benchmarks/bridge_export.py                 # ~0.5B-parameter model (Qwen2-0.5B shape), TP=2
    python benchmarks/bridge_export.py --small         # a quick 60M-parameter run

On 2 gloo ranks it measures, in the same processes and back to back:
  memcpy      copying a 256 MiB tensor (the ceiling for any in-memory repacking)
  all-gather  gloo all-gather of 128 MiB per rank (the ceiling for moving TP shards)
  export      rlmega.bridge.export_hf_weights over the whole model, every tensor to every rank
  pieces      rlmega.bridge.pieces.local_pieces: each rank's own pieces of the HF tensors, no gather (what an
              engine that reshards on its side, vLLM's nccl_m2n, is handed)
and prints each as GB/s (bytes of full HF tensors delivered per second) with the export's ratio to
the other two, then the pieces' wall time and the bytes each rank hands over, next to the export's.
Absolute numbers vary run to run on shared machines; the ratios are the result.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

GIB = 1024**3
MIB = 1024**2

QWEN2_05B = dict(
    architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
)
SMALL = dict(QWEN2_05B, vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2)


def _best_seconds(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _measure(rank: int, world_size: int, hf_config: dict, tp: int, bucket_bytes: int) -> dict:
    from rlmega.bridge import export_hf_weights
    from rlmega.bridge.pieces import local_pieces
    from rlmega.models import build_chunks, model_spec_from_hf
    from rlmega.parallel.layout import ParallelLayout, destroy, initialize

    layout = ParallelLayout(tp=tp, world_size=world_size)
    initialize(layout)
    torch.set_num_threads(1)

    source, target = torch.empty(256 * MIB, dtype=torch.uint8), torch.empty(256 * MIB, dtype=torch.uint8)
    memcpy_s = _best_seconds(lambda: target.copy_(source))
    source = target = None  # free them before the model is built

    shard = torch.empty(128 * MIB, dtype=torch.uint8)
    gathered = torch.empty(128 * MIB * world_size, dtype=torch.uint8)
    allgather_s = _best_seconds(lambda: dist.all_gather_into_tensor(gathered, shard))
    shard = gathered = None

    spec = model_spec_from_hf(hf_config)
    chunks = build_chunks(spec, layout)
    exported = {"bytes": 0, "tensors": 0}

    def export():
        exported.update(bytes=0, tensors=0)
        for _, tensor in export_hf_weights(chunks, spec, bucket_bytes=bucket_bytes):
            exported["bytes"] += tensor.numel() * tensor.element_size()
            exported["tensors"] += 1

    export_s = _best_seconds(export, repeats=2)
    handed = {"bytes": 0}

    def pieces():
        handed.update(bytes=0)
        for _, tensor in local_pieces(chunks, spec):
            handed["bytes"] += tensor.numel() * tensor.element_size()

    pieces()  # the layout is announced once (a collective), as the export's plan was in its first run
    pieces_s = _best_seconds(pieces, repeats=2)
    parameters = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    destroy()
    return dict(
        memcpy_gbps=256 * MIB / memcpy_s / 1e9,
        allgather_gbps=128 * MIB * world_size / allgather_s / 1e9,
        export_gbps=exported["bytes"] / export_s / 1e9,
        export_s=export_s,
        exported_gib=exported["bytes"] / GIB,
        tensors=exported["tensors"],
        local_parameters=parameters,
        pieces_s=pieces_s,
        pieces_gib=handed["bytes"] / GIB,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a 60M-parameter model instead of ~0.5B")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel ranks (default: 2)")
    parser.add_argument("--bucket-mib", type=int, default=256, help="export bucket size in MiB (default: 256)")
    args = parser.parse_args()

    from rlmega.parallel.spawn import run_on_ranks

    config = SMALL if args.small else QWEN2_05B
    results = run_on_ranks(_measure, args.tp, timeout_s=1800, args=(config, args.tp, args.bucket_mib * MIB))
    result = min(results, key=lambda r: r["export_gbps"])  # the slowest rank bounds the export
    print(f"model: {config['architectures'][0]} shape, hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
          f"{result['exported_gib']:.2f} GiB exported as {result['tensors']} HF tensors; TP={args.tp}, "
          f"bucket {args.bucket_mib} MiB, gloo")
    print(f"{'measure':<12}{'GB/s':>8}{'export / it':>14}")
    for name, key in (("memcpy", "memcpy_gbps"), ("all-gather", "allgather_gbps"), ("export", "export_gbps")):
        print(f"{name:<12}{result[key]:>8.2f}{result['export_gbps'] / result[key]:>14.2f}")
    print(f"export wall time {result['export_s']:.2f} s, {result['exported_gib']:.2f} GiB to each rank")
    slowest = max(results, key=lambda r: r["pieces_s"])
    print(f"pieces wall time {slowest['pieces_s']:.3f} s (export / pieces: {result['export_s'] / slowest['pieces_s']:.0f}x), "
          f"handed over per rank: " + ", ".join(f"{r['pieces_gib']:.2f}" for r in results) + " GiB")


if __name__ == "__main__":
    main()

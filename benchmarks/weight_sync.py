"""Weight sync from TP=2 Megatron ranks into a transformers engine in its own Ray actor process.

    python benchmarks/weight_sync.py            # ~0.5B parameters (Qwen2-0.5B shape), fp32
    python benchmarks/weight_sync.py --small    # a quick 60M-parameter run

In one run, on the same machine and processes:
  transport   bytes / second of sending a bucket-sized tensor to the actor and writing it there
              (the raw bandwidth of this transport, Ray's object store)
  sync        rlmega.sync.push_weights: bridge export from the TP=2 ranks, buckets to the actor,
              copied into the engine's weights, version committed
and prints the bytes moved, both rates, and sync time against bytes / transport rate (target: within
1.5x). A post-sync check confirms the engine serves the synced weights.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

MIB = 1024**2

QWEN2_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
)
SMALL = dict(QWEN2_05B, vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2)


def _transport_seconds(actor, bucket_bytes: int, repeats: int = 3) -> float:
    import ray

    payload = [("probe", torch.empty(bucket_bytes // 4, dtype=torch.float32))]
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        ray.get(actor.__ray_call__.remote(lambda self, tensors: sum(t.sum().item() * 0 for _, t in tensors), payload))
        best = min(best, time.perf_counter() - started)
    return best


def _measure(rank: int, world_size: int, hf_dir: str, bucket_bytes: int) -> dict:
    from rlmega.bridge import load_hf_weights
    from rlmega.models import build_chunks, model_spec_from_hf
    from rlmega.parallel.layout import ParallelLayout, destroy, initialize
    from rlmega.sync import post_sync_check, push_weights

    layout = ParallelLayout(tp=world_size, world_size=world_size)
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, layout)
    load_hf_weights(chunks, spec, hf_dir)
    engine, transport_s = None, None
    if rank == 0:
        import ray

        from rlmega.rollout.ray_actor import RemoteEngine, start_engine_actor

        ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
                 object_store_memory=4 * bucket_bytes + 512 * MIB, log_to_driver=False)
        engine = RemoteEngine(start_engine_actor(hf_dir), bucket_bytes=bucket_bytes)
        engine.weight_version()  # wait for the actor to load its checkpoint
        transport_s = _transport_seconds(engine.actor, bucket_bytes)
    stats = push_weights(chunks, spec, engine, version=1, bucket_bytes=bucket_bytes)
    worst = post_sync_check(chunks, spec, engine, [[1, 2, 3, 4]], max_new_tokens=4)
    if rank == 0:
        import ray

        ray.shutdown()
    destroy()
    return dict(bytes=stats.bytes, seconds=stats.seconds, tensors=stats.tensors, transport_s=transport_s, worst=worst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a 60M-parameter model instead of ~0.5B")
    parser.add_argument("--bucket-mib", type=int, default=128, help="sync bucket size in MiB (default: 128)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlmega.testing.multirank import run_on_ranks

    bucket_bytes = args.bucket_mib * MIB
    with tempfile.TemporaryDirectory() as hf_dir:
        config = Qwen2Config(**(SMALL if args.small else QWEN2_05B))
        AutoModelForCausalLM.from_config(config).float().save_pretrained(hf_dir)
        result = run_on_ranks(_measure, 2, timeout_s=1800, args=(hf_dir, bucket_bytes))[0]
    rate = bucket_bytes / result["transport_s"]
    ideal = result["bytes"] / rate
    print(f"model: Qwen2 shape, hidden {config.hidden_size}, {config.num_hidden_layers} layers; "
          f"{result['bytes'] / 2**30:.2f} GiB in {result['tensors']} tensors; TP=2 gloo ranks -> Ray actor, "
          f"bucket {args.bucket_mib} MiB")
    print(f"transport   {rate / 1e9:6.2f} GB/s  (one {args.bucket_mib} MiB bucket to the actor)")
    print(f"sync        {result['bytes'] / result['seconds'] / 1e9:6.2f} GB/s  {result['seconds']:.2f} s "
          f"= {result['seconds'] / ideal:.2f} x bytes/transport ({ideal:.2f} s; target <= 1.5x)")
    print(f"post-sync check: max log-prob difference {result['worst']:.2e}")


if __name__ == "__main__":
    main()

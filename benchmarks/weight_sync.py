"""Weight sync from TP=2 Megatron ranks into a transformers engine, through each transport.

    python benchmarks/weight_sync.py            # ~0.5B parameters (Qwen2-0.5B shape), fp32
    python benchmarks/weight_sync.py --small    # a quick 60M-parameter run

In one run, on the same machine and processes, for each transport of ``rlmega.sync``, one after
the other (each the best of two):
  export      the bridge's bucketed export to the engine's rank alone, nothing sent on
  transport   the transport alone: the same buckets, exported beforehand and held in memory, streamed
              into the engine and copied into its weights (bytes / this time = the transport's raw
              bandwidth, protocol and copy-in included)
  sync        rlmega.sync.push_weights with that transport: export, buckets shipped while the next is
              gathered, copied in, version committed
It prints bytes, each rate, sync / (bytes / raw bandwidth) (target: within 1.5x), and sync against the
best an overlapped pipeline can do, max(export, transport). A post-sync check after each sync confirms
the engine serves the synced weights at the synced version. The engine is an HFEngine in a Ray actor
for ``object_store``, ``shared_memory`` and ``broadcast``, and in the sending rank's process for
``in_process``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

MIB = 1024**2
REPEATS = 2  # each measurement: the best of this many (the first pays page faults)
TRANSPORT_NAMES = ("in_process", "object_store", "shared_memory", "broadcast")

QWEN2_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
)
SMALL = dict(QWEN2_05B, vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2)


def _timed(function, *args, **kwargs) -> tuple[float, object]:
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return time.perf_counter() - started, result


def _best_of(repeats: int, function, *args, **kwargs) -> float:
    return min(_timed(function, *args, **kwargs)[0] for _ in range(repeats))


def _measure(rank: int, world_size: int, hf_dir: str, bucket_bytes: int, names: tuple[str, ...]) -> dict:
    import torch.distributed as dist

    from rlmega.bridge import load_hf_weights
    from rlmega.bridge.export import export_hf_buckets
    from rlmega.models import build_chunks, model_spec_from_hf
    from rlmega.parallel.layout import ParallelLayout, destroy, initialize
    from rlmega.sync import make_transport, post_sync_check, push_weights, require_version, stream_update

    layout = ParallelLayout(tp=world_size, world_size=world_size)
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, layout)
    load_hf_weights(chunks, spec, hf_dir)
    engines = {}
    if rank == 0:
        import ray

        from rlmega.rollout import HFEngine
        from rlmega.trainer.engine_actor import RemoteEngine, start_engine_actor

        ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
                 object_store_memory=6 * bucket_bytes + 1024 * MIB, log_to_driver=False)
        remote = RemoteEngine(start_engine_actor(hf_dir), bucket_bytes=bucket_bytes)
        remote.weight_version()  # wait for the actor to load its checkpoint
        engines = {name: remote for name in names if name != "in_process"}
        if "in_process" in names:
            engines["in_process"] = HFEngine(hf_dir)

    buckets = list(export_hf_buckets(chunks, spec, bucket_bytes=bucket_bytes, destinations=[0]))
    results = {}
    for index, name in enumerate(names):
        # Measured next to each other, so the machine's load drifts less between them. Versions only
        # grow on an engine: this transport's runs use base+1 ... base+2*REPEATS.
        export_s = _best_of(REPEATS, push_weights, chunks, spec, None, 0, bucket_bytes=bucket_bytes)
        base = index * 2 * REPEATS
        transport_s = None
        if rank == 0:
            transport_s = float("inf")
            for version in range(base + 1, base + REPEATS + 1):
                transport = make_transport(name, [engines[name]], bucket_bytes=bucket_bytes)
                transport_s = min(transport_s, _timed(stream_update, transport, [engines[name]], buckets, version)[0])
                require_version(engines[name], version)
        sync_s = float("inf")
        for version in range(base + REPEATS + 1, base + 2 * REPEATS + 1):
            dist.barrier()
            seconds, stats = _timed(push_weights, chunks, spec, engines.get(name), version,
                                    bucket_bytes=bucket_bytes, transport=name)
            sync_s = min(sync_s, seconds)
        worst = post_sync_check(chunks, spec, engines.get(name), [[1, 2, 3, 4]], max_new_tokens=2, version=version)
        results[name] = dict(export_s=export_s, transport_s=transport_s, sync_s=sync_s, bytes=stats.bytes,
                             tensors=stats.tensors, buckets=len(buckets), worst=worst)
    if rank == 0:
        import ray

        ray.shutdown()
    destroy()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a 60M-parameter model instead of ~0.5B")
    parser.add_argument("--bucket-mib", type=int, default=None,
                        help="sync bucket size in MiB (default: 128, with --small 16)")
    parser.add_argument("--transports", default=",".join(TRANSPORT_NAMES),
                        help=f"comma-separated, in the order measured (default: {','.join(TRANSPORT_NAMES)})")
    args = parser.parse_args()
    names = tuple(args.transports.split(","))
    unknown = sorted(set(names) - set(TRANSPORT_NAMES))
    if unknown:
        parser.error(f"unknown transports {unknown}; choose from {list(TRANSPORT_NAMES)}")

    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlmega.parallel.spawn import run_on_ranks

    args.bucket_mib = args.bucket_mib or (16 if args.small else 128)
    bucket_bytes = args.bucket_mib * MIB
    with tempfile.TemporaryDirectory() as hf_dir:
        config = Qwen2Config(**(SMALL if args.small else QWEN2_05B))
        AutoModelForCausalLM.from_config(config).float().save_pretrained(hf_dir)
        result = run_on_ranks(_measure, 2, timeout_s=3600, args=(hf_dir, bucket_bytes, names))[0]
    first = next(iter(result.values()))
    nbytes = first["bytes"]
    print(f"model: Qwen2 shape, hidden {config.hidden_size}, {config.num_hidden_layers} layers; "
          f"{nbytes / 2**30:.2f} GiB in {first['tensors']} tensors, {first['buckets']} buckets of <= "
          f"{args.bucket_mib} MiB (a larger tensor travels alone); TP=2 gloo ranks; best of {REPEATS} each")
    print(f"{'transport':<14} {'export GB/s':>11} {'raw GB/s':>9} {'sync GB/s':>9} {'sync s':>7} "
          f"{'sync/(bytes/raw)':>17} {'sync/max(export,raw)':>21} {'check':>8}")
    for name, r in result.items():
        floor = max(r["export_s"], r["transport_s"])
        print(f"{name:<14} {nbytes / r['export_s'] / 1e9:11.2f} {nbytes / r['transport_s'] / 1e9:9.2f} "
              f"{nbytes / r['sync_s'] / 1e9:9.2f} {r['sync_s']:7.2f} {r['sync_s'] / r['transport_s']:16.2f}x "
              f"{r['sync_s'] / floor:20.2f}x {r['worst']:8.1e}")


if __name__ == "__main__":
    main()

"""mcore-to-hf throughput against the disk's own sequential write bandwidth, and peak memory
against the bucket size, for two model sizes, in one run.

    python benchmarks/convert.py                       # 4- and 16-layer models (0.44 / 0.98 GB fp32)
    python benchmarks/convert.py --layers 2 4          # quicker
    python benchmarks/convert.py --workdir /scratch    # measure another filesystem

For each size it saves a real torch_dist checkpoint from a randomly initialised Megatron model on
2 gloo ranks at TP=2 (each layer of each TP shard is its own stored chunk, as in training), then,
back to back on the same filesystem:
  disk write   writing as many bytes as the export, in 64 MiB blocks, fsynced; best of two runs
               before and two after the conversions (shared disks vary a lot)
  file copy    reading the checkpoint's files and writing their bytes into one file, fsynced, best
               of two: what any converter that reads and writes every byte once could do at best
  memcpy       a 256 MiB in-memory copy in the converting process, just before it converts
  mcore-to-hf  converters.mcore_to_hf.convert in a fresh process (shards fsynced too), best of --runs
It prints the conversion's bytes per second end to end and for the streaming phase alone (without
the up-front checks, which cost about a second whatever the size), their ratio to the disk's and
the stream's to the file copy's; and the converting process's peak resident memory above its
resident memory just before converting (largest over the runs; Linux: VmHWM after a reset through
/proc/self/clear_refs), next to the bucket size and the largest tensor. The bound is about two
buckets (one read while the other is written) plus the largest tensor twice (as assembled and as
the stored chunks it is read from). Both models share their largest tensor (the embedding), so a
bounded converter peaks the same for both. The checkpoint is read back from the page cache (it was
just written), as on a node that converts right after saving.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path

MIB = 1024**2
GB = 1e9

BASE = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5,
    tie_word_embeddings=False, dtype="float32",
)


def _save_rank(rank: int, world_size: int, hf_config: dict, directory: str) -> None:
    from megatron.core import dist_checkpointing

    from rlmega.models import build_chunks, model_spec_from_hf
    from rlmega.parallel.layout import ParallelLayout, destroy, initialize

    layout = ParallelLayout(tp=world_size, world_size=world_size)
    initialize(layout)
    spec = model_spec_from_hf(hf_config)
    [chunk] = build_chunks(spec, layout)
    dist_checkpointing.save({"model": chunk.sharded_state_dict()}, directory)
    destroy()


def make_checkpoint(hf_config: dict, root: Path) -> tuple[Path, Path]:
    """(HF base directory with config.json, torch_dist checkpoint directory)."""
    import json

    from rlmega.parallel.spawn import run_on_ranks

    base, checkpoint = root / "hf-base", root / "megatron"
    base.mkdir(parents=True)
    checkpoint.mkdir()
    (base / "config.json").write_text(json.dumps(hf_config))
    run_on_ranks(_save_rank, 2, timeout_s=1800, args=(hf_config, str(checkpoint)))
    return base, checkpoint


def checkpoint_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob("*.distcp"))


def file_copy_seconds(checkpoint: Path, directory: Path, block: int = 64 * MIB) -> float:
    """Seconds to copy the checkpoint's files into one file, fsynced (best of two): what any
    converter that reads and writes every byte once could at best do."""
    best = float("inf")
    for attempt in range(2):
        path = directory / f"copy-probe-{attempt}"
        start = time.perf_counter()
        with open(path, "wb") as handle:
            for source in sorted(checkpoint.glob("*.distcp")):
                with open(source, "rb") as reader:
                    while data := reader.read(block):
                        handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        best = min(best, time.perf_counter() - start)
        path.unlink()
    return best


def disk_write_seconds(directory: Path, nbytes: int, block: int = 64 * MIB) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync them (best of two)."""
    data = os.urandom(block)
    best = float("inf")
    for attempt in range(2):
        path = directory / f"disk-probe-{attempt}"
        start = time.perf_counter()
        with open(path, "wb") as handle:
            written = 0
            while written < nbytes:
                handle.write(data[: min(block, nbytes - written)])
                written += block
            handle.flush()
            os.fsync(handle.fileno())
        best = min(best, time.perf_counter() - start)
        path.unlink()
    return best


def _convert_child(checkpoint: str, output: str, base: str, bucket_bytes: int, results) -> None:
    import importlib

    import torch

    from converters import mcore_to_hf

    for module in ("transformers", "transformers.core_model_loading", "rlmega.bridge.mapping"):
        importlib.import_module(module)  # imported before the baseline: their memory is not the conversion's
    torch.set_num_threads(1)
    memcpy_s = _memcpy_seconds(torch)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = _status_kib("VmRSS")
    result = mcore_to_hf.convert(checkpoint, output, base, bucket_bytes=bucket_bytes, quiet=True)
    results.put(dict(seconds=result.seconds, stream_seconds=result.stream_seconds, nbytes=result.bytes_written,
                     peak_extra=(_status_kib("VmHWM") - baseline) * 1024, memcpy=256 * MIB / memcpy_s / GB))


def _memcpy_seconds(torch, nbytes: int = 256 * MIB) -> float:
    """Best of three copies of ``nbytes`` between two buffers (freed before the conversion)."""
    source, target = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return best


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def convert_in_fresh_process(checkpoint: Path, output: Path, base: Path, bucket_bytes: int) -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_convert_child, args=(str(checkpoint), str(output), str(base), bucket_bytes, results))
    process.start()
    process.join(timeout=1800)
    if process.exitcode != 0:
        process.kill()
        raise RuntimeError(f"conversion process exited with {process.exitcode}")
    shutil.rmtree(output)
    return results.get(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs=2, default=[4, 16], help="layer counts of the two models")
    parser.add_argument("--bucket-mib", type=int, default=64, help="conversion bucket size in MiB (default: 64)")
    parser.add_argument("--runs", type=int, default=3, help="conversions per model, best one counted (default: 3)")
    parser.add_argument("--workdir", default=None, help="where checkpoints and exports go (default: a temp dir)")
    args = parser.parse_args()

    largest = BASE["vocab_size"] * BASE["hidden_size"] * 4
    print(f"bucket {args.bucket_mib} MiB, largest tensor (embedding) {largest / MIB:.0f} MiB")
    print(f"{'layers':>6} {'bytes':>9} {'memcpy GB/s':>11} {'disk GB/s':>9} {'copy GB/s':>9} {'convert GB/s':>12} "
          f"{'stream GB/s':>11} {'convert/disk':>12} {'stream/disk':>11} {'stream/copy':>11} {'peak RSS MiB':>12}")
    for num_layers in args.layers:
        root = Path(tempfile.mkdtemp(prefix="rlmega-convert-bench-", dir=args.workdir))
        try:
            base, checkpoint = make_checkpoint(dict(BASE, num_hidden_layers=num_layers), root)
            before = disk_write_seconds(root, checkpoint_bytes(checkpoint))
            runs = [convert_in_fresh_process(checkpoint, root / f"hf-{run}", base, args.bucket_mib * MIB)
                    for run in range(args.runs)]
            measured = min(runs, key=lambda run: run["stream_seconds"])
            measured["seconds"] = min(run["seconds"] for run in runs)
            measured["peak_extra"] = max(run["peak_extra"] for run in runs)
            disk_s = min(before, disk_write_seconds(root, measured["nbytes"]))  # the disk at its best
            copy = checkpoint_bytes(checkpoint) / file_copy_seconds(checkpoint, root) / GB
            disk, nbytes = measured["nbytes"] / disk_s / GB, measured["nbytes"]
            convert_rate = nbytes / measured["seconds"] / GB
            stream_rate = nbytes / measured["stream_seconds"] / GB
            print(f"{num_layers:>6} {nbytes / GB:>7.2f}GB {measured['memcpy']:>11.2f} {disk:>9.3f} {copy:>9.3f} "
                  f"{convert_rate:>12.3f} {stream_rate:>11.3f} {convert_rate / disk:>12.2f} {stream_rate / disk:>11.2f} "
                  f"{stream_rate / copy:>11.2f} {measured['peak_extra'] / MIB:>12.0f}")
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

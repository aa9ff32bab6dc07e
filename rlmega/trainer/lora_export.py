"""The final export of a LoRA actor, from the live model (its checkpoints hold the adapters alone): the merged weights
``W + scale * B @ A`` as an HF checkpoint, and the adapters as a PEFT adapter directory. Each is written into a
hidden sibling directory and renamed when complete."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

EXPORT_SHARD_BYTES = 4 * 1024**3
"""Largest safetensors file of the merged checkpoint (as ``save_pretrained`` shards)."""


def export_lora(worker, merged_dir: Path, adapter_dir: Path, base_model: str) -> Optional[str]:
    """``_export`` with the actor's weights on its devices (brought in for it if offloaded)."""
    offloaded = worker.offloaded
    if offloaded:
        worker.onload()
    try:
        return _export(worker, merged_dir, adapter_dir, base_model)
    finally:
        if offloaded:
            worker.offload()


def _export(worker, merged_dir: Path, adapter_dir: Path, base_model: str) -> Optional[str]:
    """Write ``merged_dir`` (HF checkpoint, names and files of ``base_model``) and ``adapter_dir`` (PEFT, unless the
    adapters were folded into the base: they then apply to the warm-started model only); collective over the actor's
    ranks, rank 0 writes. Returns a note on what was not written, if anything."""
    from converters.hf_files import read_base, write_model_files
    from converters.output import atomic_directory
    from safetensors.torch import save_file

    from rlmega.workers.lora_export import peft_adapter

    rank0 = dist.get_rank() == 0
    config = read_base(Path(base_model))[0] if rank0 else None
    with atomic_directory(merged_dir, overwrite=True) if rank0 else contextlib.nullcontext() as partial:
        writer = _ShardWriter(partial) if rank0 else None
        for name, tensor in worker.export_hf_weights(destinations=[0]):
            if writer is not None:
                writer.add(name, tensor)
        if writer is not None:
            writer.close()
            write_model_files(Path(base_model), partial, config, writer.dtype)
    if worker.base_folded:  # a rank-r adapter of the base it was folded into, not of ``base_model``
        dist.barrier()
        return (f"no PEFT adapter written: the adapters were folded into the base after the warm-start, so they do "
                f"not apply to {base_model}; {merged_dir} holds the merged model")
    adapter = peft_adapter(worker.chunks, worker.spec, worker.config.lora, str(base_model))
    if rank0:
        tensors, adapter_config = adapter
        with atomic_directory(adapter_dir, overwrite=True) as partial:
            save_file(tensors, str(partial / "adapter_model.safetensors"))
            (partial / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    dist.barrier()
    return None


class _ShardWriter:
    """Safetensors files of at most ``EXPORT_SHARD_BYTES``, each written as soon as it is full (rank 0 holds one
    shard, not the model): ``model.safetensors`` alone, or ``model-0000k.safetensors`` and their index."""

    def __init__(self, directory: Path):
        self.directory, self.files, self.weight_map, self.total = directory, [], {}, 0
        self.shard: dict[str, torch.Tensor] = {}
        self.size, self.dtype = 0, None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.shard and self.size + tensor.nbytes > EXPORT_SHARD_BYTES:
            self._flush()
        self.shard[name] = tensor.detach().cpu().clone()
        self.size += tensor.nbytes
        self.dtype = tensor.dtype

    def _flush(self) -> None:
        from safetensors.torch import save_file

        file_name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.shard, str(self.directory / file_name), metadata={"format": "pt"})
        self.files.append(file_name)
        self.weight_map.update({name: file_name for name in self.shard})
        self.total += self.size
        self.shard, self.size = {}, 0

    def close(self) -> None:
        self._flush()
        if len(self.files) == 1:
            (self.directory / self.files[0]).rename(self.directory / "model.safetensors")
            return
        (self.directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, indent=2) + "\n")

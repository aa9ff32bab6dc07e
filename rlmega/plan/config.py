"""The hardware a run is planned for (``plan:`` in the config tree): GPU memory, nodes, link speeds,
and the few assumptions the planner cannot measure. Only ``rlmega plan`` reads this slice."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class GpuPreset:
    memory_gib: float
    """Total memory as ``nvidia-smi`` reports it (MiB / 1024)."""
    nvlink_gb_per_s: float
    """NVLink bandwidth of one GPU in one direction (half the bidirectional figure NVIDIA quotes)."""
    bf16_tflops: float = 989.0
    """Dense bf16 tensor-core peak (TFLOP/s), for the layout search's cost model only."""
    hbm_tb_per_s: float = 3.35
    """Memory bandwidth (TB/s), for the layout search's cost model only (decoding reads the weights)."""


GPU_PRESETS = {
    "H100": GpuPreset(memory_gib=81559 / 1024, nvlink_gb_per_s=450.0),   # H100 SXM5 80 GB, NVLink 4
    "H200": GpuPreset(memory_gib=143771 / 1024, nvlink_gb_per_s=450.0, hbm_tb_per_s=4.8),  # H200 SXM 141 GB
    "B200": GpuPreset(memory_gib=183359 / 1024, nvlink_gb_per_s=900.0, bf16_tflops=2250.0,  # B200 180 GB, NVLink 5
                      hbm_tb_per_s=8.0),
}


@dataclasses.dataclass
class PlanConfig:
    gpu: str = "H100"
    """A preset (H100, H200, B200) or any name with ``gpu_memory_gib`` and ``nvlink_gb_per_s`` set."""
    gpu_memory_gib: Optional[float] = None
    """Memory of one GPU; None: the preset's."""
    nvlink_gb_per_s: Optional[float] = None
    """NVLink of one GPU, one direction (GB/s); None: the preset's."""
    gpus_per_node: int = 8
    ib_gb_per_s: float = 400.0
    """InfiniBand of one node, one direction (GB/s; 8 x 400 Gb/s NICs = 400); one GPU's traffic to another
    node gets this divided by ``gpus_per_node`` (one NIC per GPU)."""
    message_latency_us: float = 20.0
    """What one message of the sliced weight transfer costs beside its bytes (microseconds; an assumption: a
    NCCL or RDMA send of a small block, its launch and completion), per GPU, for the more of its sent and received
    messages."""
    object_store_gb_per_s: float = 5.0
    """Ray's object store between two nodes (GB/s), used by the object_store sync transport (an assumption:
    it goes through host memory and TCP)."""
    host_copy_gb_per_s: float = 12.8
    """Host memory copy of large buffers on an engine's node (GB/s): vLLM's collective_rpc passes every weight
    bucket through host shared memory once per worker of a TP > 1 engine. The default is memcpy as measured on a
    CPU machine, an assumption for a GPU node: measure it there (``bash tests/gpu/run_gpu_checks.sh --tier cluster
    --only host-memcpy`` prints it) and set it."""
    host_memory_gib: float = 2048.0
    """Host memory of one node (a DGX H100 has 2 TiB)."""
    reserved_gib: float = 4.0
    """Per GPU, outside any tensor the planner counts: CUDA contexts of the trainer and engine processes,
    NCCL buffers, allocator fragmentation (an assumption)."""
    engine_workspace_gib: float = 4.0
    """Per engine GPU, inside the engine's memory share but outside weights and KV cache: activations of
    a scheduling step, CUDA graphs, sampler buffers (an assumption; vLLM and SGLang profile their own)."""
    min_headroom_gib: float = 4.0
    """A rank fits when at least this much of its GPU is left in its fullest phase."""

    def preset(self) -> GpuPreset:
        """The GPU's memory and NVLink, from the preset and the fields set here."""
        base = GPU_PRESETS.get(self.gpu)
        memory = self.gpu_memory_gib or (base.memory_gib if base else None)
        nvlink = self.nvlink_gb_per_s or (base.nvlink_gb_per_s if base else None)
        if memory is None or nvlink is None:
            raise ValueError(f"plan.gpu={self.gpu!r} is not a preset ({', '.join(GPU_PRESETS)}); "
                             "set plan.gpu_memory_gib and plan.nvlink_gb_per_s for it")
        speeds = dict(bf16_tflops=base.bf16_tflops, hbm_tb_per_s=base.hbm_tb_per_s) if base else {}
        return GpuPreset(memory_gib=memory, nvlink_gb_per_s=nvlink, **speeds)

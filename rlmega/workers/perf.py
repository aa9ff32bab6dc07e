"""Throughput, model-FLOPs utilisation and memory of a worker's passes, as step metrics.

FLOPs follow the usual dense estimate: 6 per active parameter per token for forward + backward
(2 for forward only), where an MoE layer's active experts count ``topk / num_experts`` of its
expert parameters; attention's sequence-quadratic term is left out (small at RL lengths and
hidden sizes, and it makes the estimate conservative). MFU needs the device's peak: known for
common GPUs, otherwise only achieved TFLOP/s are reported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlmega.models.spec import ModelSpec

# Dense bf16 peak TFLOP/s per device, by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "B200": 2250.0}


def _active_parameters(chunks: list, spec: ModelSpec) -> float:
    """Parameters that act on each token, over the whole model (collective)."""
    from megatron.core import parallel_state as ps

    dense = torch.zeros(1, dtype=torch.float64)
    expert = torch.zeros(1, dtype=torch.float64)
    for chunk in chunks:
        for param in chunk.parameters():
            if getattr(param, "allreduce", True):
                dense += param.numel()
            else:
                expert += param.numel()
    if dist.is_initialized():
        # Dense parameters are split over TP and PP only; experts over every rank except expert-DP replicas.
        dist.all_reduce(dense, group=ps.get_model_parallel_group())
        dist.all_reduce(expert)
        expert /= ps.get_expert_data_parallel_world_size()
    active_share = spec.config.get("moe_router_topk", 1) / spec.num_experts if spec.num_experts else 1.0
    return float(dense + expert * active_share)


def peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def memory_metrics() -> dict[str, float]:
    if torch.cuda.is_available():
        return {"perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
                "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 2**30}
    import psutil

    return {"perf/cpu_memory_used_gb": psutil.Process().memory_info().rss / 2**30}


class PerfCounter:
    def __init__(self, chunks: list, spec: ModelSpec):
        self.active_parameters = _active_parameters(chunks, spec)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1

    def report(self, num_tokens: int, seconds: float, *, training: bool) -> dict[str, float]:
        """Metrics of a pass over ``num_tokens`` tokens (the whole batch, all ranks) in ``seconds``."""
        flops = (6.0 if training else 2.0) * self.active_parameters * num_tokens
        tflops_per_device = flops / max(seconds, 1e-9) / self.world_size / 1e12
        metrics = {"perf/tokens_per_s": num_tokens / max(seconds, 1e-9), "perf/tflops_per_device": tflops_per_device}
        peak = peak_tflops()
        if peak:
            metrics["perf/mfu"] = tflops_per_device / peak
        metrics.update(memory_metrics())
        return metrics

"""Which GPUs a colocated vLLM / SGLang engine runs on: those of the training ranks it shares.

A colocated engine with ``rollout.gpus_per_engine=0`` asks Ray for no GPU of its own (the training ranks
hold them all, and the two take turns with the memory). Ray then shows the engine's process every GPU of the
node (or, in some releases, none), and the engine would start on the node's first: every engine on GPU 0.
So engine i is given the devices of ranks ``i*g .. i*g+g-1`` (wrapping around the world), ``g`` being its
tensor x data parallel size, as ``CUDA_VISIBLE_DEVICES`` (kept from Ray by its NOSET switch), and is placed
in the first of those ranks' bundles.
"""

from __future__ import annotations

import dataclasses

from rlmega.config.schema import RLConfig
from rlmega.errors import UserError

# Ray sets the CUDA_VISIBLE_DEVICES of an actor with no GPU to "" in some releases (2.40 does, 2.60 leaves it):
# this switch, read by every release (ray/_private/accelerators/nvidia_gpu.py), keeps the value given here.
KEEP_VISIBLE_DEVICES = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


@dataclasses.dataclass(frozen=True)
class EnginePlace:
    bundle: int
    """The training placement group's bundle (= training rank) the engine's actor goes in."""
    visible_devices: str
    """Its ``CUDA_VISIBLE_DEVICES``: the devices of the ranks it shares, as Ray named them to those ranks."""

    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": self.visible_devices, **KEEP_VISIBLE_DEVICES}


def shares_rank_gpus(config: RLConfig) -> bool:
    """Whether the run's engines run on the training ranks' GPUs: colocated vLLM / SGLang engines with
    no GPU of their own, beside ranks that have some. (The hf engine then runs on the CPU, as configured.)"""
    rollout = config.rollout
    return (rollout.placement == "colocated" and rollout.backend != "hf" and rollout.gpus_per_engine == 0
            and config.cluster.gpus_per_rank > 0)


def colocated_engine_places(ranks: list[dict], num_engines: int, gpus_per_engine: int) -> list[EnginePlace]:
    """Where each of ``num_engines`` engines of ``gpus_per_engine`` GPUs runs, from the training ranks'
    ``{"rank", "node_id", "gpus"}`` (``gpus``: the rank's CUDA_VISIBLE_DEVICES). An engine's ranks must be on
    one node and hold ``gpus_per_engine`` distinct devices between them."""
    world = len(ranks)
    if gpus_per_engine > world:
        raise UserError(f"a colocated engine needs rollout.tensor_parallel_size x data_parallel_size = "
                        f"{gpus_per_engine} GPUs, but there are only {world} training ranks to share: make the "
                        f"engine smaller, or give engines GPUs of their own (rollout.placement=disaggregated)")
    places = []
    for engine in range(num_engines):
        shared = [ranks[(engine * gpus_per_engine + offset) % world] for offset in range(gpus_per_engine)]
        nodes = sorted({rank["node_id"] for rank in shared})
        if len(nodes) > 1:
            raise UserError(f"colocated rollout engine {engine} would span training ranks "
                            f"{[rank['rank'] for rank in shared]} on {len(nodes)} nodes; an engine runs on one "
                            f"node: make rollout.tensor_parallel_size x data_parallel_size ({gpus_per_engine}) "
                            f"divide the training ranks per node")
        devices = list(dict.fromkeys(device for rank in shared for device in rank["gpus"].split(",") if device))
        if len(devices) < gpus_per_engine:
            raise UserError(f"colocated rollout engine {engine} needs {gpus_per_engine} GPUs, but training ranks "
                            f"{[rank['rank'] for rank in shared]} hold {len(devices)} ({','.join(devices) or 'none'}): "
                            f"give each rank a whole GPU (cluster.gpus_per_rank=1)")
        places.append(EnginePlace(bundle=shared[0]["rank"], visible_devices=",".join(devices[:gpus_per_engine])))
    return places

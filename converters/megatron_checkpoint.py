"""Read the model tensors of a Megatron ``torch_dist`` checkpoint without a process group.

Megatron's ``dist_checkpointing`` stores each parameter as one *global* tensor, whatever layout
saved it: tensor-parallel shards are concatenated (QKV in the TP=1 interleaved layout, SwiGLU
``linear_fc1`` as ``[gate; up]``), the embedding keeps its padded vocabulary rows, and layers and
experts become leading axes:

- ``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[num_layers, ...]`` (the default);
- ``decoder.layers.{i}.…`` per layer when the layers differ (a dense/MoE mix, ``non_homogeneous_layers``);
- ``….mlp.experts.experts.linear_fc1.weight`` with an expert axis ``[.., num_experts, ...]``, or
  ``….mlp.experts.experts.{e}.linear_fc1.weight_w`` / ``_v`` (gate / up) with ``singleton_local_shards``;
- ``mtp.layers.{k}.…`` for multi-token-prediction layer k;
- local-spec norms under the TE spec's names (``linear_qkv.layer_norm_weight``).

``parse_key`` turns a stored key into the canonical per-layer names of ``rlmega.bridge``; the
reader loads exactly the regions asked for (one layer of one expert, say) with
``torch.distributed.checkpoint``'s own resharding, so memory follows what is read, not the file.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from converters.chunk_reader import DirectChunkReader
from converters.errors import ConversionError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
# Optimizer state: "optimizer.…", or "chained_{i}.optimizer.…" when dense and expert parameters
# have separate optimizers (MoE).
_OPTIMIZER_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.")
STORES_TIED_HEAD = "rlmega.hf_stores_tied_lm_head"
"""``content_metadata`` key that hf-to-mcore sets when its source, though it ties the LM head to the
embedding, also stored ``lm_head.weight`` (equal to the embedding; many Qwen / Llama checkpoints do):
mcore-to-hf then writes the head back, so a round trip gives exactly the source's keys."""

_STACK = re.compile(r"^(?P<stack>decoder|mtp)\.layers\.(?:(?P<layer>\d+)\.)?(?P<rest>.+)$")
_EXPERTS = re.compile(r"^(?P<head>(?:.+\.)?mlp\.experts\.)experts\.(?:(?P<expert>\d+)\.)?(?P<tail>.+)$")
_GLU_PART = re.compile(r"^(?P<base>.+\.(?:weight|bias))_(?P<part>[wv])$")


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The directory holding ``.metadata``: ``path`` itself, or the iteration its tracker file names."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    tracker = path / TRACKER_FILE
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            iteration = path / "release"
        elif text.isdigit():
            iteration = path / f"iter_{int(text):07d}"
        else:
            raise ConversionError(f"{tracker} holds {text!r}, not an iteration number; write the number of a saved iteration into it")
        if not (iteration / ".metadata").is_file():
            raise ConversionError(
                f"{tracker} names iteration {text}, but {iteration} is not a complete torch_dist checkpoint "
                "(no .metadata); pass an iter_NNNNNNN directory that exists"
            )
        return iteration
    if not path.exists():
        raise ConversionError(f"checkpoint {path} does not exist; pass an iter_NNNNNNN directory or its parent")
    raise ConversionError(
        f"{path} is not a torch_dist checkpoint (no .metadata) and has no {TRACKER_FILE}; "
        "pass an iter_NNNNNNN directory or its parent"
    )


@dataclasses.dataclass(frozen=True)
class Region:
    """One block of a stored tensor: ``offsets`` and ``sizes`` per dimension of the global tensor."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    squeeze: int
    """Leading (layer / expert) axes to drop after reading."""

    @property
    def nbytes(self) -> int:
        return torch.Size(self.sizes).numel() * self.dtype.itemsize

    @property
    def shape(self) -> tuple[int, ...]:
        return self.sizes[self.squeeze:]


@dataclasses.dataclass(frozen=True)
class StoredParam:
    """A per-layer Megatron parameter under its canonical name, and where its data is stored.

    ``parts`` are concatenated along dim 0 (gate and up when SwiGLU is stored as ``_w`` / ``_v``).
    """

    canonical: str
    parts: tuple[Region, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape
        return (sum(part.shape[0] for part in self.parts), *first[1:]) if first else first

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype


def _canonical(key: str, indices: dict, num_layers: int) -> str:
    match = _STACK.match(key)
    if not match:
        return key
    layer = int(match["layer"]) if match["layer"] is not None else indices["layer"]
    rest = match["rest"]
    expert = _EXPERTS.match(rest)
    if expert:
        index = int(expert["expert"]) if expert["expert"] is not None else indices["expert"]
        rest = f"{expert['head']}local_experts.{index}.{expert['tail']}"
    if match["stack"] == "mtp":  # rlmega names MTP layer k by its transformer layer's index
        return f"mtp.layers.{num_layers + layer}.{rest}"
    return f"decoder.layers.{layer}.{rest}"


def leading_axes(key: str) -> list[str]:
    """The layer / expert axes that a stored key's tensor has in front of the parameter's own."""
    axes = []
    match = _STACK.match(key)
    if match:
        if match["layer"] is None:
            axes.append("layer")
        expert = _EXPERTS.match(match["rest"])
        if expert and expert["expert"] is None:
            axes.append("expert")
    return axes


def parse_key(key: str, metadata: TensorStorageMetadata, num_layers: int) -> Iterator[tuple[str, Optional[int], Region]]:
    """``(canonical name, GLU part or None, region)`` for every layer / expert the key stores.

    Only indices some saved chunk covers are returned: a layer-stacked tensor of a dense/MoE mix
    has no data for the layers of the other kind.
    """
    from rlmega.bridge.mapping import canonical_te_name

    glu = _GLU_PART.match(key)
    name = glu["base"] if glu else key
    part = None if glu is None else "wv".index(glu["part"])
    axes = leading_axes(name)
    size = tuple(metadata.size)
    present = set()
    for chunk in metadata.chunks:
        ranges = [range(chunk.offsets[d], chunk.offsets[d] + chunk.sizes[d]) for d in range(len(axes))]
        present.update(itertools.product(*ranges))
    for index in sorted(present):
        region = Region(key, (*index, *[0] * (len(size) - len(axes))), (*[1] * len(axes), *size[len(axes):]),
                        metadata.properties.dtype, len(axes))
        yield canonical_te_name(_canonical(name, dict(zip(axes, index)), num_layers)), part, region


def _cause(error: BaseException) -> str:
    """The underlying error of a (per-rank wrapped) checkpoint failure, on one line."""
    failures = getattr(error, "failures", None)  # {rank: (exception, traceback frames)}
    if failures:
        first = next(iter(failures.values()))
        error = first[0] if isinstance(first, tuple) and isinstance(first[0], BaseException) else error
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class _RegionPlanner(LoadPlanner):
    """Loads chosen regions of stored tensors into given buffers (no state dict involved)."""

    def __init__(self, regions: list[Region], buffers: list[torch.Tensor]):
        self.targets: dict[str, list[tuple[Region, torch.Tensor]]] = {}
        for region, buffer in zip(regions, buffers):
            self.targets.setdefault(region.key, []).append((region, buffer))

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, targets in self.targets.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(r.offsets), sizes=torch.Size(r.sizes)) for r, _ in targets]
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise AssertionError(f"unexpected non-tensor read of {read_item.dest_index.fqn}")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        _, buffer = self.targets[read_item.dest_index.fqn][read_item.dest_index.index]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            buffer = buffer.narrow(dim, start, length)
        return buffer

    def commit_tensor(self, read_item, tensor) -> None:
        pass


class MegatronCheckpoint:
    """The model tensors of one torch_dist checkpoint directory (see ``resolve_checkpoint_dir``)."""

    def __init__(self, path: str | Path):
        from rlmega.bridge import CheckpointError
        from rlmega.bridge.torch_dist_files import read_backend, read_index

        self.directory = resolve_checkpoint_dir(path)
        self.reader = DirectChunkReader(str(self.directory))
        try:
            backend = read_backend(self.directory)
            self.metadata = read_index(self.directory, self.reader)
        except CheckpointError as error:  # names metadata.json or .metadata
            raise ConversionError(str(error)) from None
        kind = None if backend is None else backend.get("sharded_backend")
        if backend is not None and kind != "torch_dist":
            raise ConversionError(
                f"{self.directory} was saved with the {kind!r} backend; only torch_dist is read here "
                "(re-save it with dist_checkpointing's torch_dist strategy)"
            )

    def tensor_keys(self) -> dict[str, TensorStorageMetadata]:
        """Every stored tensor that is model state: optimizer state and non-tensor objects
        (``_extra_state``, RNG states, ...) are left out."""
        return {
            key: md for key, md in self.metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata) and not _OPTIMIZER_KEY.match(key)
        }

    def params(self, num_layers: int) -> list[StoredParam]:
        """The model's per-layer parameters, in stored-key order (GLU halves joined)."""
        parts: dict[str, dict] = {}
        for key, md in sorted(self.tensor_keys().items()):
            for canonical, part, region in parse_key(key, md, num_layers):
                parts.setdefault(canonical, {})[part] = region
        params = []
        for canonical, found in parts.items():
            if None in found:
                params.append(StoredParam(canonical, (found[None],)))
            elif sorted(found) == [0, 1]:
                params.append(StoredParam(canonical, (found[0], found[1])))
            else:
                raise ConversionError(
                    f"{self.directory} stores only one SwiGLU half of {canonical!r} (_w without _v or back); "
                    "the checkpoint is incomplete, re-save it"
                )
        return params

    def content_metadata(self) -> dict:
        """What ``dist_checkpointing.save(..., content_metadata=...)`` recorded (in ``common.pt`` up to
        Megatron-Core 0.18, inside the checkpoint's files from 0.19); {} if none."""
        from megatron.core.dist_checkpointing import load_content_metadata

        from rlmega.bridge import CheckpointError
        from rlmega.bridge.torch_dist_files import read_common

        try:
            common = read_common(self.directory)
        except CheckpointError as error:
            raise ConversionError(str(error)) from None
        return load_content_metadata(preloaded_state_dict=common) or {}

    def check_files(self, keys: set[str]) -> None:
        """Raise ConversionError if a shard file holding any of ``keys`` is missing or too short."""
        from rlmega.bridge import CheckpointError
        from rlmega.bridge.torch_dist_files import check_files

        try:
            check_files(self.directory, self.metadata, keys)
        except CheckpointError as error:
            raise ConversionError(str(error)) from None

    def read(self, regions: list[Region]) -> list[torch.Tensor]:
        """The tensors of ``regions``, leading layer/expert axes dropped; one pass over the files."""
        buffers = [torch.empty(region.sizes, dtype=region.dtype) for region in regions]
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore")
                dcp.load({}, storage_reader=self.reader, planner=_RegionPlanner(regions, buffers), no_dist=True)
        except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
            from rlmega.bridge.torch_dist_files import find_damage

            damage = find_damage(self.directory) or f"reading {self.directory} failed ({_cause(error)}): it is damaged"
            raise ConversionError(f"{damage}; copy it again from the original checkpoint") from error
        return [buffer.reshape(region.shape) for buffer, region in zip(buffers, regions)]

"""A stand-in for ``vllm.distributed.weight_transfer`` (0.33.0): ``ParamMeta``, ``Shard``, ``Replicate`` and
``WeightSource`` of ``base``, as the resharding backends read a trainer's weights; and the trainer side of the
``sharded_rdt`` backend (``factory.WeightTransferTrainerFactory``, ``sharded_rdt_trainer``), with ``pull`` for the
workers' side (``fake_vllm.LLM.update_weights``).

Constructor arguments are bound to the fields recorded from the wheel (``api/vllm.json``: which are positional,
which keyword-only), and each ``ParamMeta`` is checked as the wheel's ``__post_init__`` checks it: owners are
distinct non-negative ints; a mesh or placements need owners; the mesh covers the owners; one placement per mesh
axis; a ``Shard`` names a dimension of the tensor; all-``Replicate`` placements become None. ``WeightSource``
requires ``metadata`` to be a ``functools.cached_property`` (vLLM raises at class creation otherwise) and derives
``owned_names`` from ``metadata`` as the wheel does (owners None: every rank).

The ``sharded_rdt`` trainer keeps the wheel's rules (sharded_rdt_trainer.py; ``api/rules.json`` sharded_rdt_min_ray
and sharded_rdt_group_contiguous): Ray at least the tested release; a source is required; its metadata
must be group-contiguous (``layerwise_groups``: one group per outermost index, names without one before the first
indexed name in a leading group, after it in a trailing one); ``TrainerInitInfo.rank`` must be the default
group's rank; the metadata must agree on every rank; ``iter_full`` must yield exactly the owned names, in
metadata order, group by group; only the sender calls the client, in the order init (once), then per sync
start, update (concurrently with the publishing) and finish. Its producers are folders: each rank saves the
tensors it owns, per sync, under ``$RLMEGA_FAKE_RDT_DIR/rank<r>``, the folder standing for the producer actor's
name, and ``pull`` reads every name from an owner's folder, as the workers pull from an owner's actor.

``modules()`` are the ``sys.modules`` entries that make ``from vllm.distributed.weight_transfer import base``
(``factory``, ``sharded_rdt_trainer``) find it.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
import threading
import time
import types
from abc import ABC, abstractmethod
from pathlib import Path

import torch
import torch.distributed as dist

from . import api_snapshot

API = api_snapshot.load("vllm")


def _bind(cls: str, args: tuple, kwargs: dict, bases: tuple = ()) -> dict:
    """``args`` / ``kwargs`` bound to ``cls``'s recorded fields, after its dataclass ``bases``' (keyword-only where
    the wheel says so; a dataclass puts keyword-only fields last)."""
    fields = [field for base in (*bases, cls) for field in API["fields"][base]["fields"]]
    fields.sort(key=lambda field: bool(field[2] and "kw_only=True" in field[2]))
    parameters = []
    for name, _annotation, default, has_default in fields:
        kind = (inspect.Parameter.KEYWORD_ONLY if default and "kw_only=True" in default
                else inspect.Parameter.POSITIONAL_OR_KEYWORD)
        parameters.append(inspect.Parameter(name, kind, default=None if has_default else inspect.Parameter.empty))
    try:
        bound = inspect.Signature(parameters).bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"vllm {API['version']} {cls}: {error}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


class Replicate:
    def __init__(self, *args, **kwargs):
        _bind("Replicate", args, kwargs)

    def __eq__(self, other):
        return isinstance(other, Replicate)

    def __hash__(self):
        return hash("Replicate")


class Shard:
    def __init__(self, *args, **kwargs):
        self.dim = _bind("Shard", args, kwargs)["dim"]

    def __eq__(self, other):
        return isinstance(other, Shard) and other.dim == self.dim

    def __hash__(self):
        return hash(("Shard", self.dim))


class ParamMeta:
    def __init__(self, *args, **kwargs):
        fields = _bind("ParamMeta", args, kwargs)
        self.name, self.dtype, self.shape = fields["name"], fields["dtype"], tuple(fields["shape"])
        self.owners, self.mesh_shape, self.placements = fields["owners"], fields["mesh_shape"], fields["placements"]
        check = functools.partial(api_snapshot.refusal, "vllm", "param_meta_checks", name=self.name)
        if self.owners is None:
            if self.mesh_shape is not None or self.placements is not None:
                raise ValueError(check("no_owners"))
            return
        owners = tuple(self.owners)
        if (not owners or any(not isinstance(r, int) or isinstance(r, bool) for r in owners) or min(owners) < 0
                or len(set(owners)) != len(owners)):
            raise ValueError(check("owners", owners=self.owners))
        mesh = tuple(self.mesh_shape) if self.mesh_shape is not None else (len(owners),)
        if any(d <= 0 for d in mesh) or math.prod(mesh) != len(owners):
            raise ValueError(check("mesh", mesh=mesh, count=len(owners)))
        placements = self.placements
        if placements is not None:
            placements = tuple(placements)
            if len(placements) != len(mesh):
                raise ValueError(check("placements", count=len(placements), dims=len(mesh)))
            for placement in placements:
                if isinstance(placement, Shard):
                    if not 0 <= placement.dim < len(self.shape):
                        raise ValueError(check("shard_dim", dim=placement.dim, dims=len(self.shape)))
                elif not isinstance(placement, Replicate):
                    raise TypeError(f"parameter {self.name!r} placement {placement!r} is neither Replicate nor Shard")
            if all(isinstance(p, Replicate) for p in placements):
                placements = None
        self.owners, self.mesh_shape, self.placements = owners, mesh, placements


class WeightSource(ABC):
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        metadata = cls.__dict__.get("metadata")
        if metadata is not None and not isinstance(metadata, functools.cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

    @property
    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        raise NotImplementedError

    def owned_names(self, rank: int) -> list[str]:
        api_snapshot.check_call(API, "WeightSource.owned_names", rank)
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def iter_full(self):
        raise NotImplementedError

    def iter_local(self):
        raise NotImplementedError


# ---- the sharded_rdt backend's trainer side (factory.py, sharded_rdt_trainer.py) -----------------------------

def layerwise_groups(names: list[str]) -> list[list[str]]:
    """base.layerwise_groups' partition, by its documented rule."""
    pre, post, stacks = [], [], {}
    for name in names:
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if index is None:
            (post if stacks else pre).append(name)
            continue
        stacks.setdefault((".".join(parts[:index]), int(parts[index])), []).append(name)
    prefixes = list(dict.fromkeys(prefix for prefix, _ in stacks))
    ordered = sorted(stacks, key=lambda key: (prefixes.index(key[0]), key[1]))
    return ([pre] if pre else []) + [stacks[key] for key in ordered] + ([post] if post else [])


def check_ray_rdt_version() -> None:
    """``api/rules.json`` sharded_rdt_min_ray: the installed Ray at least the tested one (the fake stands in for
    nixl, so its import is not checked)."""
    import importlib.metadata

    from packaging import version

    required = version.parse(api_snapshot.rule("vllm", "sharded_rdt_min_ray")["ray"])
    current = version.parse(importlib.metadata.version("ray"))
    if current < required:
        raise ValueError(api_snapshot.refusal("vllm", "sharded_rdt_min_ray", required=required, current=current))


class TrainerInitInfo:
    backend = None

    def __init__(self, *args, **kwargs):
        for name, value in _bind(type(self).__name__, args, kwargs, bases=("TrainerInitInfo",)).items():
            setattr(self, name, value)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class ShardedRDTTrainerInitInfo(TrainerInitInfo):
    backend = "sharded_rdt"


class ShardedRDTTrainer:
    """sharded_rdt_trainer.ShardedRDTTrainerWeightTransferEngine, with folders for its producer actors."""

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        refuse = functools.partial(api_snapshot.refusal, "vllm", "sharded_rdt_trainer_init")
        if source is None:
            raise ValueError(refuse("source"))
        self = cls()
        self.info, self.client, self.source, self.syncs = init_info, client, source, 0
        self.meta = list(source.metadata)
        names = [m.name for m in self.meta]
        self.groups = layerwise_groups(names)
        if [name for group in self.groups for name in group] != names:  # api/rules.json sharded_rdt_group_contiguous
            raise ValueError(api_snapshot.refusal("vllm", "sharded_rdt_group_contiguous"))
        check_ray_rdt_version()  # where the wheel's trainer spawns its producer actors
        world = dist.get_world_size() if dist.is_initialized() else 1
        if dist.is_initialized() and dist.get_rank() != init_info.rank:
            raise ValueError(refuse("rank", rank=init_info.rank, group_rank=dist.get_rank()))
        owner_sets, name_owner_class = [], []
        for m in self.meta:
            owners = list(range(world)) if m.owners is None else list(m.owners)
            if max(owners) >= world:
                raise ValueError(refuse("owners", name=m.name, owners=owners, world=world))
            if sorted(owners) not in owner_sets:
                owner_sets.append(sorted(owners))
            name_owner_class.append(owner_sets.index(sorted(owners)))
        self.owned = set(source.owned_names(init_info.rank))
        self.folder = Path(os.environ["RLMEGA_FAKE_RDT_DIR"]) / f"rank{init_info.rank}"
        described = [(m.name, m.owners) for m in self.meta]
        gathered = [None] * world
        if dist.is_initialized():
            dist.all_gather_object(gathered, (str(self.folder), described))
        else:
            gathered = [(str(self.folder), described)]
        differing = [rank for rank, other in enumerate(gathered) if other[1] != described]
        if differing:
            raise ValueError(refuse("disagree", rank=init_info.rank, digest=hash(str(described)), ranks=differing[:4]))
        if init_info.is_sender:
            client.init_weight_transfer_engine(dict(
                trainer_actor_names=[folder for folder, _ in gathered],
                trainer_actor_namespace=init_info.trainer_actor_namespace, names=names,
                dtype_names=[str(m.dtype).split(".")[-1] for m in self.meta], shapes=[list(m.shape) for m in self.meta],
                group_lens=[len(group) for group in self.groups], owner_sets=owner_sets,
                name_owner_class=name_owner_class, num_consumers=init_info.num_consumers,
                num_rdt_buffers=init_info.num_rdt_buffers, buffer_presize_gb=init_info.buffer_presize_gb))
        return self

    def send_weights(self, *args, **kwargs) -> None:
        api_snapshot.check_call(API, "ShardedRDTTrainerWeightTransferEngine.send_weights", *args, **kwargs)
        if not self.info.is_sender:
            self._publish()
            return
        self.client.start_weight_update()
        failure = []
        update = threading.Thread(target=lambda: _keep_error(failure, self.client.update_weights, {}), daemon=True)
        update.start()
        self._publish()
        update.join()
        if failure:
            raise failure[0]
        self.client.finish_weight_update()

    def _publish(self) -> None:
        """Each owned group, from ``iter_full`` in metadata order, saved where ``pull`` finds it."""
        folder = self.folder / f"sync{self.syncs}"
        folder.mkdir(parents=True, exist_ok=True)
        pairs = self.source.iter_full()
        for group in self.groups:
            expected = [name for name in group if name in self.owned]
            got = [next(pairs, (None, None)) for _ in expected]
            if [name for name, _ in got] != expected:
                raise RuntimeError(f"WeightSource yielded {[n for n, _ in got][:2]!r} for a group where this rank "
                                   f"owns {expected[:2]!r}; iter_full() must yield the owned names in metadata order.")
            for name, tensor in got:
                torch.save(tensor.detach().cpu().clone(), folder / f"{name}.pt.tmp")
                os.replace(folder / f"{name}.pt.tmp", folder / f"{name}.pt")
        if next(pairs, None) is not None:
            raise RuntimeError("WeightSource.iter_full() yielded names this rank does not own")
        self.syncs += 1

    def shutdown(self) -> None:
        pass


def _keep_error(failure: list, function, *args) -> None:
    try:
        function(*args)
    except BaseException as error:  # noqa: BLE001 - re-raised by the sender
        failure.append(error)


def pull(init_info: dict, sync: int, timeout_s: float = 120.0):
    """A worker's pull of sync number ``sync``: every name from its first owner's producer, whole."""
    deadline = time.monotonic() + timeout_s
    for index, name in enumerate(init_info["names"]):
        owner = init_info["owner_sets"][init_info["name_owner_class"][index]][0]
        path = Path(init_info["trainer_actor_names"][owner]) / f"sync{sync}" / f"{name}.pt"
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no trainer rank published {name} for sync {sync}")
            time.sleep(0.01)
        yield name, torch.load(path)


class WeightTransferTrainerFactory:
    @classmethod
    def trainer_init(cls, *args, **kwargs):
        api_snapshot.check_call(API, "WeightTransferTrainerFactory.trainer_init", *args, **kwargs)
        init_info = args[0] if args else kwargs["init_info"]
        if init_info.backend != "sharded_rdt":
            raise ValueError(api_snapshot.refusal("vllm", "weight_transfer_backend", backend=init_info.backend,
                                                  available=["sharded_rdt"]))
        return ShardedRDTTrainer.trainer_init(init_info, client=kwargs["client"], source=kwargs.get("source"))


def modules() -> dict[str, types.ModuleType]:
    """The ``sys.modules`` entries under which ``from vllm.distributed.weight_transfer import base`` (and
    ``import vllm``) find the fakes."""
    from . import fake_vllm

    this = sys.modules[__name__]
    distributed = types.ModuleType("vllm.distributed")
    weight_transfer = types.ModuleType("vllm.distributed.weight_transfer")
    weight_transfer.base, distributed.weight_transfer = this, weight_transfer
    weight_transfer.factory = weight_transfer.sharded_rdt_trainer = this
    return {"vllm": fake_vllm, "vllm.distributed": distributed, "vllm.distributed.weight_transfer": weight_transfer,
            "vllm.distributed.weight_transfer.base": this, "vllm.distributed.weight_transfer.factory": this,
            "vllm.distributed.weight_transfer.sharded_rdt_trainer": this}

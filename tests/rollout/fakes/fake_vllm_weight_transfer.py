"""A stand-in for ``vllm.distributed.weight_transfer.base`` (0.33.0): ``ParamMeta``, ``Shard``, ``Replicate`` and
``WeightSource``, as the resharding backends read a trainer's weights.

Constructor arguments are bound to the fields recorded from the wheel (``api/vllm.json``: which are positional,
which keyword-only), and each ``ParamMeta`` is checked as the wheel's ``__post_init__`` checks it: owners are
distinct non-negative ints; a mesh or placements need owners; the mesh covers the owners; one placement per mesh
axis; a ``Shard`` names a dimension of the tensor; all-``Replicate`` placements become None. ``WeightSource``
requires ``metadata`` to be a ``functools.cached_property`` (vLLM raises at class creation otherwise) and derives
``owned_names`` from ``metadata`` as the wheel does (owners None: every rank).

``modules()`` are the ``sys.modules`` entries that make ``from vllm.distributed.weight_transfer import base`` find it.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import types
from abc import ABC, abstractmethod

from . import api_snapshot

API = api_snapshot.load("vllm")


def _bind(cls: str, args: tuple, kwargs: dict) -> dict:
    """``args`` / ``kwargs`` bound to ``cls``'s recorded fields (keyword-only where the wheel says so)."""
    parameters = []
    for name, _annotation, default, has_default in API["fields"][cls]["fields"]:
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
        if self.owners is None:
            if self.mesh_shape is not None or self.placements is not None:
                raise ValueError(f"parameter {self.name!r} declares a mesh or placements without owners")
            return
        owners = tuple(self.owners)
        if (not owners or any(not isinstance(r, int) or isinstance(r, bool) for r in owners) or min(owners) < 0
                or len(set(owners)) != len(owners)):
            raise ValueError(f"parameter {self.name!r} owners must be distinct non-negative ranks, got {owners}")
        mesh = tuple(self.mesh_shape) if self.mesh_shape is not None else (len(owners),)
        if any(d <= 0 for d in mesh) or math.prod(mesh) != len(owners):
            raise ValueError(f"parameter {self.name!r} mesh_shape {mesh} does not cover its {len(owners)} owners")
        placements = self.placements
        if placements is not None:
            placements = tuple(placements)
            if len(placements) != len(mesh):
                raise ValueError(f"parameter {self.name!r} has {len(placements)} placements for a {len(mesh)}-D mesh")
            for placement in placements:
                if isinstance(placement, Shard):
                    if not 0 <= placement.dim < len(self.shape):
                        raise ValueError(f"parameter {self.name!r} shards dim {placement.dim} of a "
                                         f"{len(self.shape)}-D tensor")
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


def modules() -> dict[str, types.ModuleType]:
    """The ``sys.modules`` entries under which ``from vllm.distributed.weight_transfer import base`` (and
    ``import vllm``) find the fakes."""
    from . import fake_vllm

    this = sys.modules[__name__]
    distributed = types.ModuleType("vllm.distributed")
    weight_transfer = types.ModuleType("vllm.distributed.weight_transfer")
    weight_transfer.base, distributed.weight_transfer = this, weight_transfer
    return {"vllm": fake_vllm, "vllm.distributed": distributed, "vllm.distributed.weight_transfer": weight_transfer,
            "vllm.distributed.weight_transfer.base": this}

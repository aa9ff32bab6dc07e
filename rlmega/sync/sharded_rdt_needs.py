"""What ``sync.transport=sharded_rdt`` needs beyond vLLM, in one place for setup.py's ``sharded_rdt`` extra, the
check before the transfer starts, and ``rlmega doctor``.

vLLM 0.33 / 0.34 (vllm/distributed/weight_transfer/sharded_rdt_common.py): Ray at least ``RDT_MIN_RAY_VERSION``
(2.56.0, checked by ``check_ray_rdt_version`` only at the first pull) and the ``nixl`` package, which its workers
import to register tensors with Ray's direct transport (vllm/distributed/nixl_utils.py).
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable
from typing import Optional

MIN_RAY = (2, 56)
NIXL = "nixl"
# setup.py's extra installs exactly this (tests/sync/test_sharded_rdt_needs.py reads setup.py).
EXTRA = ["vllm>=0.33,<0.35", f"ray[default]>={MIN_RAY[0]}.{MIN_RAY[1]},<3", f"{NIXL}>=1.5,<2"]
INSTALL = "pip install 'rlmega[sharded_rdt]'"


def installed_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing(version_of: Optional[Callable[[str], Optional[str]]] = None) -> list[str]:
    """What is missing for the transport, one phrase each ([] when nothing is); ``version_of(distribution)`` gives
    a version or None (default: what is installed here)."""
    version_of, found = version_of or installed_version, []
    ray = version_of("ray")
    numbers = tuple(int(part) for part in re.findall(r"\d+", ray or "")[:2])
    if ray is None or numbers < MIN_RAY:
        found.append(f"ray>={MIN_RAY[0]}.{MIN_RAY[1]} (installed: {ray or 'none'})")
    if version_of(NIXL) is None:
        found.append(f"{NIXL} (not installed)")
    return found


def require() -> None:
    """Raise ``RuntimeError`` naming what is missing and the install command, before any engine is touched."""
    lacking = missing()
    if lacking:
        raise RuntimeError(f"sync.transport=sharded_rdt needs {' and '.join(lacking)}: {INSTALL}, or choose another "
                           "sync.transport")

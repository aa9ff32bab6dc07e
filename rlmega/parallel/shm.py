"""Regions of /dev/shm that several processes of this host map: made by one, opened by the others.

The weight sync's shared-memory transport (``rlmega.sync.shared_memory``) and the collectives of ranks on one host
(``rlmega.parallel.host_collectives``) both hand a region from the process that makes it to the processes that map
it by name, and unlink the name once every process has mapped it.
"""

from __future__ import annotations

import mmap
import os

import torch


def create_region(path: str, nbytes: int) -> torch.Tensor:
    """A new file of ``nbytes`` at ``path`` (refused if the name exists; readable by this user only), mapped as
    bytes. On failure nothing is left at ``path``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def map_region(path: str, nbytes: int) -> torch.Tensor:
    """The region another process made at ``path``, mapped as bytes. Opened without O_CREAT: if the name is
    gone this fails, instead of mapping a fresh empty file."""
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)

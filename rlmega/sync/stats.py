"""What one weight sync moved, and how fast."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class SyncStats:
    version: int
    tensors: int
    bytes: int
    """This rank's share of the bytes moved."""
    seconds: float
    transport: Optional[str] = None  # None on the ranks that hold no engine

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

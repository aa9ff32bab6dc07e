"""What both fakes know of a vision-language checkpoint: its image pad token and patch geometry (config.json), and
the pad runs an engine locates each image's features by."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Vision:
    image_token_id: int
    merge: int
    patch: int
    temporal: int

    def tokens(self, grid) -> int:
        """Pad tokens of one image: its patches over merge**2."""
        return int(grid.prod()) // self.merge**2


def vision_of(model_path: str) -> Optional[Vision]:
    config = json.loads((Path(model_path) / "config.json").read_text())
    vision = config.get("vision_config")
    if not vision or config.get("image_token_id") is None:
        return None
    return Vision(config["image_token_id"], vision.get("spatial_merge_size", 2), vision.get("patch_size", 14),
                  vision.get("temporal_patch_size", 2))


def pad_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of ``token``."""
    runs: list[tuple[int, int]] = []
    for position, value in enumerate(ids):
        if value == token:
            if runs and sum(runs[-1]) == position:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((position, 1))
    return runs

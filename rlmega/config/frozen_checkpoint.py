"""The check of a frozen model's checkpoint (the reward model, a distillation teacher): an HF checkpoint whose
architecture rlmega builds, with the output layer its role needs, whose weights are all there, and which fits its
own layout."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def frozen_checkpoint_problem(section: str, path, layout, head: str) -> Optional[tuple[str, str]]:
    """(field, what is wrong) for the first problem of the checkpoint at ``path`` serving role ``head`` (``reward``,
    ``teacher``) at ``layout`` (a ``LayoutConfig``), under ``section``; None when it can serve."""
    from rlmega.bridge import HFCheckpoint
    from rlmega.models import UnsupportedModelError, model_spec_from_hf
    from rlmega.parallel.layout import LayoutError
    from rlmega.workers.model import check_head

    what = "reward model" if head == "reward" else head
    if path is None or not (Path(path) / "config.json").is_file():
        return f"{section}.path", f"no HF checkpoint (config.json) at {path}; the {what} needs one"
    try:
        spec = model_spec_from_hf(path)
        check_head(spec, head)
        HFCheckpoint(path)  # a missing or damaged safetensors file, named
    except (UnsupportedModelError, ValueError, FileNotFoundError) as problem:
        return f"{section}.path", str(problem)
    try:
        spec.check_layout(layout.build())
    except LayoutError as problem:
        return f"{section}.layout", str(problem)
    return None

"""Compare an exported HF directory with a reference HF directory.

Tensors are compared key by key, one at a time (memory: two tensors): equal dtypes must match bit
for bit. When a dtype differs (an export cast to bf16, say), or when asked, both models also run
on fixed probe tokens in fp32 and their logits must agree within ``atol``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from converters.errors import ConversionError

DEFAULT_ATOL = 1e-4
"""fp32 logits of the same weights agree to ~1e-6; 1e-4 is the bridge's acceptance bound."""
PROBE_SHAPE = (2, 16)


@dataclasses.dataclass
class Report:
    differences: list[str] = dataclasses.field(default_factory=list)
    """One line per differing key (or the logits), naming it and how it differs."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Keys whose dtype differs (not failures by themselves: the logits decide)."""
    structural: bool = False
    """A key is missing, extra or mis-shaped: the models are not comparable by logits."""
    num_identical: int = 0
    num_compared: int = 0
    logits_max_abs_diff: float | None = None

    @property
    def ok(self) -> bool:
        return not self.differences


def _open(directory: Path):
    from rlmega.bridge import CheckpointError, HFCheckpoint

    try:
        return HFCheckpoint(directory)  # every shard opened: a missing or damaged one is named
    except FileNotFoundError as error:
        raise ConversionError(f"{error}; pass a directory written by save_pretrained or mcore-to-hf") from None
    except CheckpointError as error:
        raise ConversionError(str(error)) from None


def compare_tensors(exported: Path, reference: Path, report: Report) -> bool:
    """Fill ``report`` with per-key differences; True if some dtype differs (bits cannot match)."""
    ours, theirs = _open(exported), _open(reference)
    for name in sorted(theirs.keys() - ours.keys()):
        report.differences.append(f"{name}: missing from {exported}")
    for name in sorted(ours.keys() - theirs.keys()):
        report.differences.append(f"{name}: not in the reference {reference}")
    report.structural = bool(report.differences)
    dtype_differs = False
    for name in sorted(ours.keys() & theirs.keys()):
        report.num_compared += 1
        a, b = ours.read(name), theirs.read(name)
        if a.shape != b.shape:
            report.structural = True
            report.differences.append(f"{name}: shape {list(a.shape)} vs reference {list(b.shape)}")
        elif a.dtype != b.dtype:
            dtype_differs = True
            diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            report.notes.append(f"{name}: {a.dtype} vs reference {b.dtype}, max abs diff {diff:.3g}")
        elif torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            report.num_identical += 1
        else:
            diff = (a.double() - b.double()).abs().max().item()
            report.differences.append(f"{name}: values differ, max abs diff {diff:.3g} ({a.dtype})")
    return dtype_differs


def probe_tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, PROBE_SHAPE, generator=torch.Generator().manual_seed(0))


def compare_logits(exported: Path, reference: Path, atol: float, report: Report) -> None:
    """Both models' fp32 logits on the same probe tokens; a difference above ``atol`` is reported."""
    from transformers import AutoModelForCausalLM

    def logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            return model(tokens).logits

    from rlmega.models import read_hf_config

    tokens = probe_tokens(read_hf_config(reference)["vocab_size"])
    diff = (logits(exported, tokens) - logits(reference, tokens)).abs().max().item()
    report.logits_max_abs_diff = diff
    if not diff <= atol:
        report.differences.append(f"logits: max abs diff {diff:.3g} on probe tokens exceeds --atol {atol:g}")


def verify(exported: str | Path, reference: str | Path, *, logits: bool = False, atol: float = DEFAULT_ATOL) -> Report:
    from rlmega.bridge import CheckpointError

    report = Report()
    try:
        dtype_differs = compare_tensors(Path(exported), Path(reference), report)
    except CheckpointError as error:  # a shard that does not hold what the index says
        raise ConversionError(str(error)) from None
    if (logits or dtype_differs) and not report.structural:
        compare_logits(Path(exported), Path(reference), atol, report)
    return report

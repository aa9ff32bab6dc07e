"""Hugging Face safetensors -> Megatron torch_dist checkpoint for a target parallel layout.

The model is built at the target layout on spawned gloo ranks (CPU, GPUs hidden from them), filled by the bridge's
importer (each rank reads only its slices) and saved with Megatron's own
``dist_checkpointing.save``: the result is exactly what a training job at that layout would save,
including the per-layout vocabulary padding and the objects Megatron expects next to the weights.
Like any torch_dist checkpoint it also loads at other layouts with the same padded vocabulary
(``rlmega.models.padded_vocab_size``, which depends on tp only).

Memory: the ranks together hold the model once in ``--dtype``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from converters.errors import ConversionError
from converters.hf_files import config_dtype, read_base
from converters.megatron_checkpoint import STORES_TIED_HEAD, TRACKER_FILE
from converters.output import atomic_directory, check_disk_space, check_output, directory_bytes

DEFAULT_TIMEOUT_S = 3600.0


@dataclasses.dataclass(frozen=True)
class Result:
    output: Path
    checkpoint_dir: Path
    world_size: int
    bytes_written: int
    seconds: float
    notes: tuple[str, ...] = ()
    """How the checkpoint was read (``ModelSpec.notes``), one line each."""


def layout_for(tp: int = 1, pp: int = 1, vpp: Optional[int] = None, ep: int = 1, etp: Optional[int] = None,
               first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None):
    """The smallest job with these degrees: data parallel only as far as expert parallel needs it
    (``ep * etp`` must divide ``tp * dp``); uneven first / last pipeline stages as ``ParallelLayout``'s."""
    from rlmega.parallel.layout import ParallelLayout

    expert_ranks = ep * (etp or 1)
    world_size = tp * pp * (math.lcm(tp, expert_ranks) // tp)
    return ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, world_size=world_size,
                          first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)


def _save_rank(rank: int, world_size: int, layout, hf_dir: str, directory: str, dtype: torch.dtype,
               content_metadata: dict) -> None:
    from megatron.core import dist_checkpointing

    from rlmega.bridge import load_hf_weights
    from rlmega.models import build_chunks, model_spec_from_hf, sharded_model_state
    from rlmega.parallel.layout import destroy, initialize

    initialize(layout)
    spec = model_spec_from_hf(hf_dir, weights_only=True)  # as read_base: no forward pass here
    chunks = build_chunks(spec, layout, spec.transformer_config(layout, params_dtype=dtype))
    load_hf_weights(chunks, spec, hf_dir)
    # as a training job's checkpoint holds it; content_metadata: what mcore-to-hf must know of the source
    dist_checkpointing.save(sharded_model_state(chunks), directory, content_metadata=content_metadata)
    destroy()


def _inspect_hf(hf_dir: Path, dtype: torch.dtype, spec, tp: int) -> tuple[int, bool]:
    """(bytes the checkpoint will hold: every HF tensor in ``dtype``, plus the vocabulary padding;
    whether the source stores an LM head equal to the embedding it ties the head to)."""
    from rlmega.bridge import CheckpointError, HFCheckpoint
    from rlmega.bridge.load import check_tied_head
    from rlmega.bridge.mapping import RuleBook
    from rlmega.models import padded_vocab_size

    try:
        checkpoint = HFCheckpoint(hf_dir)  # every shard opened: a missing or damaged one is named
        numel = sum(math.prod(checkpoint.shape(key)) for key in checkpoint.keys())
    except FileNotFoundError as error:
        raise ConversionError(f"{error}; pass a directory saved by save_pretrained") from None
    except CheckpointError as error:
        raise ConversionError(str(error)) from None
    stores_tied_head = False
    if spec.tie_word_embeddings:
        embedding = RuleBook(spec.architecture).resolve("embedding.word_embeddings.weight")[1][0]
        try:
            stores_tied_head = check_tied_head(checkpoint, embedding)
        except CheckpointError as error:
            raise ConversionError(str(error)) from None
    hidden = spec.config["hidden_size"]
    padding = (padded_vocab_size(spec.vocab_size, tp) - spec.vocab_size) * hidden * (1 if spec.tie_word_embeddings else 2)
    return (numel + padding) * dtype.itemsize, stores_tied_head


def _watch(directory: Path, total: int, quiet: bool, stop: threading.Event) -> None:
    """A bytes progress bar over what Megatron has written so far."""
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="hf-to-mcore",
              disable=quiet, file=sys.stderr, dynamic_ncols=True) as progress:
        while not stop.wait(0.5):
            progress.update(min(directory_bytes(directory), total) - progress.n)
        progress.update(min(directory_bytes(directory), total) - progress.n)


def convert(hf_dir: str | Path, output: str | Path, layout, *, dtype: Optional[torch.dtype] = None,
            iteration: Optional[int] = None, overwrite: bool = False, quiet: bool = False,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> Result:
    """Write a torch_dist checkpoint of the HF model in ``hf_dir`` for ``layout`` to ``output``.

    ``iteration`` None writes the checkpoint directly into ``output``; a number writes Megatron's
    training layout, ``output/iter_NNNNNNN/`` plus ``output/latest_checkpointed_iteration.txt``.
    """
    from rlmega.parallel.layout import LayoutError
    from rlmega.parallel.spawn import RankFailure, run_on_ranks

    started = time.perf_counter()
    hf_dir, output = Path(hf_dir), Path(output)
    check_output(output, overwrite)
    config, spec = read_base(hf_dir)
    dtype = dtype or config_dtype(config)
    try:
        spec.check_layout(layout)
    except LayoutError as error:
        raise ConversionError(str(error)) from None
    total, stores_tied_head = _inspect_hf(hf_dir, dtype, spec, layout.tp)
    check_disk_space(output, total)

    with atomic_directory(output, overwrite) as partial:
        target = partial if iteration is None else partial / f"iter_{iteration:07d}"
        target.mkdir(exist_ok=True)
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(partial, total, quiet, stop), daemon=True)
        watcher.start()
        try:
            # cpu_only: the ranks run over gloo on the CPU, also on a GPU node, so a conversion needs no free GPUs
            run_on_ranks(_save_rank, layout.world_size, timeout_s=timeout_s, quiet=True, cpu_only=True,
                         args=(layout, str(hf_dir), str(target), dtype, {STORES_TIED_HEAD: stores_tied_head}))
        except RankFailure as failure:
            raise ConversionError(failure.cause) from failure
        finally:
            stop.set()
            watcher.join()
        if iteration is not None:
            (partial / TRACKER_FILE).write_text(f"{iteration}\n")
        written = directory_bytes(partial)
    checkpoint_dir = output if iteration is None else output / f"iter_{iteration:07d}"
    return Result(output, checkpoint_dir, layout.world_size, written, time.perf_counter() - started, spec.notes)

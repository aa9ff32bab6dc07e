"""Megatron torch_dist checkpoint -> Hugging Face safetensors directory, without building a model.

Every model tensor of the checkpoint is named canonically (``megatron_checkpoint``), mapped by the
bridge's rules (``rlmega.bridge.mapping``, the same ones the live export uses) and checked, before
anything is written, against the tensors the ``--hf-base`` config implies. Then tensors are read,
converted and written one bucket at a time, the next bucket read while the current one is written:
peak memory is about two buckets plus the largest parameter, whatever the model's size.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from converters.errors import ConversionError
from converters.hf_files import TOKENIZER_FILES, expected_tensors, read_base, write_model_files
from converters.megatron_checkpoint import STORES_TIED_HEAD, MegatronCheckpoint, StoredParam
from converters.output import atomic_directory, check_disk_space, check_output
from converters.safetensors_writer import Entry, ShardedSafetensorsWriter

DEFAULT_BUCKET_BYTES = 1024**3
DEFAULT_SHARD_BYTES = 5 * 1024**3
_EMBEDDING, _OUTPUT_LAYER = "embedding.word_embeddings.weight", "output_layer.weight"
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One Megatron parameter and the HF tensors it becomes."""

    param: StoredParam
    rule: object
    hf: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def read_bytes(self) -> int:
        return sum(region.nbytes for region in self.param.parts)


def _natural(name: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _mtp_copies(params: list[StoredParam]) -> list[StoredParam]:
    """HF's MTP layers store copies of the embedding and LM head, which Megatron's MTP shares with
    the main model: the same stored data under the MTP names the bridge maps."""
    by_name = {param.canonical: param for param in params}
    layers = sorted({int(m.group(1)) for p in params if (m := _MTP_LAYER.match(p.canonical))})
    copies = []
    for layer in layers:
        for suffix, source in (("embed_tokens.weight", _EMBEDDING), ("shared_head.head.weight", _OUTPUT_LAYER)):
            if source in by_name:
                copies.append(StoredParam(f"mtp.layers.{layer}.{suffix}", by_name[source].parts))
    return copies


def untied_if_trained_head(params: list[StoredParam], spec, config: dict, hf_base: Path) -> tuple:
    """``(spec, config, notes)`` for the export of ``params``. Megatron stores no output layer of a model that ties
    it to the embedding, so a checkpoint that has one was trained with a head of its own: exported under an
    ``--hf-base`` config that ties the head, it would be dropped. The export then keeps it as ``lm_head.weight`` and
    writes ``tie_word_embeddings: false`` (nothing is lost), saying so in a note."""
    if not spec.tie_word_embeddings or not any(param.canonical == _OUTPUT_LAYER for param in params):
        return spec, config, ()
    config = {**config, "tie_word_embeddings": False}
    if isinstance(config.get("text_config"), dict) and "tie_word_embeddings" in config["text_config"]:
        config["text_config"] = {**config["text_config"], "tie_word_embeddings": False}
    note = (f"the checkpoint has an output layer of its own, which {hf_base}/config.json ties to the embedding: "
            "it is written as lm_head.weight, with tie_word_embeddings: false in config.json")
    return dataclasses.replace(spec, tie_word_embeddings=False), config, (note,)


def plan(checkpoint: MegatronCheckpoint, params: list[StoredParam], spec, config: dict, hf_base: Path) -> list[Unit]:
    """Every HF tensor the checkpoint's ``params`` (``model_params``) become, in HF's natural order;
    ConversionError if the checkpoint and the ``--hf-base`` config disagree on any name or shape. ``spec``
    and ``config`` as ``untied_if_trained_head`` gives them."""
    from rlmega.bridge.mapping import RuleBook, hf_shapes
    from rlmega.bridge.params import geometry_of

    if spec.tie_word_embeddings:  # the embedding is the LM head; HF stores it once
        params = [param for param in params if param.canonical != _OUTPUT_LAYER]
    params = params + _mtp_copies(params)
    # A source that stored the head as well (hf-to-mcore records it) gets it back as a copy of the embedding,
    # so a round trip has exactly the source's keys.
    tied_head = spec.tie_word_embeddings and checkpoint.content_metadata().get(STORES_TIED_HEAD, False)
    if tied_head:
        params += [StoredParam(_OUTPUT_LAYER, param.parts) for param in params if param.canonical == _EMBEDDING]
    book, geometry = RuleBook(spec.architecture), geometry_of(spec)
    units = []
    for param in params:
        try:
            rule, names = book.resolve(param.canonical)
        except KeyError:
            raise ConversionError(
                f"checkpoint tensor {param.canonical!r} has no place in a {spec.architecture} model; "
                f"pass the --hf-base of the model this checkpoint was trained from (not {hf_base})"
            ) from None
        shapes = hf_shapes(rule, torch.Size(param.shape), geometry)
        units.append(Unit(param, rule, tuple(zip(names, shapes))))
    units.sort(key=lambda unit: _natural(unit.hf[0][0]))
    _check_against_base(units, spec, expected_tensors(hf_base, config, with_tied_head=tied_head), hf_base)
    return units


def model_params(checkpoint: MegatronCheckpoint, spec) -> list[StoredParam]:
    """The checkpoint's model parameters; ConversionError when it holds none."""
    params = checkpoint.params(spec.num_layers)
    if not params:
        skipped = sorted(checkpoint.metadata.state_dict_metadata)
        raise ConversionError(
            f"{checkpoint.directory} holds no model weights ({len(skipped)} entries, e.g. {skipped[:1]}, all optimizer "
            "state or non-tensor objects); pass a checkpoint saved with the model's state dict"
        )
    return params


def _check_against_base(units: list[Unit], spec, expected: dict, hf_base: Path) -> None:
    from rlmega.bridge.mapping import VOCAB

    fix = f"pass the --hf-base of the model this checkpoint was trained from (not {hf_base})"
    produced = {}
    for unit in units:
        numel = sum(torch.Size(shape).numel() for _, shape in unit.hf)
        stored = torch.Size(unit.param.shape).numel()
        if numel != stored and not (unit.rule.transform == VOCAB and numel <= stored):
            raise ConversionError(
                f"checkpoint tensor {unit.param.canonical!r} has shape {list(unit.param.shape)}, which the "
                f"--hf-base config cannot split into {[list(s) for _, s in unit.hf]}; {fix}"
            )
        for name, shape in unit.hf:
            if name in produced:
                raise ConversionError(f"checkpoint maps two tensors to {name!r}; {fix}")
            produced[name] = shape
    for name, shape in produced.items():
        layer = re.match(r"^model\.layers\.(\d+)\.", name)
        if spec.mtp_num_layers and layer and int(layer.group(1)) >= spec.num_layers:
            continue  # MTP layers: transformers does not build them, but its checkpoints carry them
        if name not in expected:
            raise ConversionError(f"the checkpoint has {name!r}, which a {spec.architecture} model per --hf-base does not; {fix}")
        if tuple(expected[name]) != tuple(shape):
            raise ConversionError(
                f"the checkpoint gives {name!r} shape {list(shape)}, the --hf-base config implies "
                f"{list(expected[name])}; {fix}"
            )
    missing = sorted(set(expected) - set(produced), key=_natural)
    if missing:
        raise ConversionError(
            f"the checkpoint has no tensor for {missing[0]!r} ({len(missing)} missing) that the --hf-base config "
            f"implies; {fix}, or a checkpoint that holds the whole model"
        )


def _read_ahead(checkpoint: MegatronCheckpoint, units: list[Unit], bucket_bytes: int):
    """(bucket, iterator over its tensors), reading bucket n+1 on a thread while bucket n is
    converted and written: file reads and writes release the GIL, so they overlap. Two buckets
    are in memory at a time."""
    from rlmega.bridge.export import bucketed

    buckets = list(bucketed(units, lambda unit: unit.read_bytes, bucket_bytes))

    def read(bucket):
        return checkpoint.read([region for unit in bucket for region in unit.param.parts])

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mcore-to-hf-read") as pool:
        pending = pool.submit(read, buckets[0])
        for index, bucket in enumerate(buckets):
            tensors = pending.result()
            if index + 1 < len(buckets):
                pending = pool.submit(read, buckets[index + 1])
            yield bucket, iter(tensors)
            del tensors


def _progress(total: int, description: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description,
                disable=quiet, file=sys.stderr, dynamic_ncols=True)


@dataclasses.dataclass(frozen=True)
class Result:
    output: Path
    num_tensors: int
    num_shards: int
    bytes_written: int
    seconds: float
    """End to end, checks included."""
    stream_seconds: float
    """Reading, converting and writing the tensors (fsynced)."""
    notes: tuple[str, ...] = ()
    """What the export did differently from the ``--hf-base`` config (``untied_if_trained_head``), one line each."""


def stored_entries(name: str, shape: tuple[int, ...], dtype: torch.dtype, fp8: bool) -> list[Entry]:
    """How the HF tensor ``name`` is stored: as it is, or with ``fp8`` a quantized weight and its scales."""
    from rlmega.bridge.fp8 import FP8_DTYPE, is_quantized, scale_name, scale_shape

    if fp8 and is_quantized(name, shape):
        return [Entry(name, shape, FP8_DTYPE), Entry(scale_name(name), scale_shape(shape), torch.float32)]
    return [Entry(name, shape, dtype)]


def stored_tensors(converted: dict[str, torch.Tensor], dtype: Optional[torch.dtype], fp8: bool):
    """The tensors ``stored_entries`` plans, in its order: quantized from the checkpoint's precision, the rest cast
    to ``dtype``."""
    from rlmega.bridge.fp8 import is_quantized, quantize_blockwise, scale_name

    for name, tensor in converted.items():
        if fp8 and is_quantized(name, tensor.shape):
            quantized, scale_inv = quantize_blockwise(tensor)
            yield name, quantized
            yield scale_name(name), scale_inv
        else:
            yield name, tensor.to(dtype or tensor.dtype)


def convert(checkpoint_path: str | Path, output: str | Path, hf_base: str | Path, *,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES, shard_bytes: int = DEFAULT_SHARD_BYTES,
            dtype: Optional[torch.dtype] = None, overwrite: bool = False, quiet: bool = False,
            fp8: bool = False) -> Result:
    """Write the HF directory ``output`` from a torch_dist checkpoint (an iteration directory or
    its parent). ``dtype`` None keeps the checkpoint's dtype. ``fp8``: linear weights as blockwise FP8 with
    their ``weight_scale_inv`` (``rlmega.bridge.fp8``) and config.json's ``quantization_config``, the format
    vLLM and SGLang serve in FP8; the other tensors in ``dtype``."""
    from rlmega.bridge.fp8 import kept_linear_modules, quantization_config
    from rlmega.bridge.mapping import to_hf
    from rlmega.bridge.params import geometry_of

    started = time.perf_counter()
    output, hf_base = Path(output), Path(hf_base)
    check_output(output, overwrite)
    # MTP as config.json says: the Megatron checkpoint decides which layers there are to export.
    config, spec = read_base(hf_base, mtp="on")
    checkpoint = MegatronCheckpoint(checkpoint_path)
    params = model_params(checkpoint, spec)
    spec, config, notes = untied_if_trained_head(params, spec, config, hf_base)
    units = plan(checkpoint, params, spec, config, hf_base)
    checkpoint.check_files({region.key for unit in units for region in unit.param.parts})
    entries = [entry for unit in units for name, shape in unit.hf
               for entry in stored_entries(name, shape, dtype or unit.param.dtype, fp8)]
    small_files = sum((hf_base / name).stat().st_size for name in TOKENIZER_FILES if (hf_base / name).is_file())
    check_disk_space(output, sum(entry.nbytes for entry in entries) + small_files + 1024**2)
    geometry = geometry_of(spec)

    with atomic_directory(output, overwrite) as partial:
        stream_started = time.perf_counter()
        writer = ShardedSafetensorsWriter(partial, entries, shard_bytes)
        try:
            with _progress(writer.total_bytes, "mcore-to-hf", quiet) as progress:
                for bucket, tensors in _read_ahead(checkpoint, units, bucket_bytes):
                    for unit in bucket:
                        parts = [next(tensors) for _ in unit.param.parts]
                        gathered = parts[0] if len(parts) == 1 else torch.cat(parts)
                        names = tuple(name for name, _ in unit.hf)
                        converted = to_hf(unit.rule, gathered, names, geometry, tp=1)
                        for name, tensor in stored_tensors(converted, dtype, fp8):
                            writer.write(name, tensor)
                            progress.update(tensor.numel() * tensor.element_size())
                    del tensors, parts, gathered
            writer.close()
        finally:
            writer.abort()
        stream_seconds = time.perf_counter() - stream_started
        if fp8:
            config = {**config, "quantization_config": quantization_config(
                kept_linear_modules((name, shape) for unit in units for name, shape in unit.hf))}
        write_model_files(hf_base, partial, config, dtype or units[0].param.dtype)
    return Result(output, len(entries), len(writer.shards), writer.total_bytes, time.perf_counter() - started,
                  stream_seconds, notes)

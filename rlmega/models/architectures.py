"""Hugging Face ``config.json`` -> ``ModelSpec``, one adapter per architecture.

``ARCHITECTURES`` maps the HF ``architectures`` entry to its adapter; ``model_spec_from_hf`` picks
the adapter and says which ones exist when the checkpoint's is not among them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Union

from rlmega.models.deepseek import deepseek_v3
from rlmega.models.hf_fields import HFConfig, UnsupportedModelError
from rlmega.models.reward_head import score_head_from_hf
from rlmega.models.spec import ModelSpec
from rlmega.models.text import llama, mixtral, qwen2, qwen3, qwen3_moe
from rlmega.models.vision_language import vision_spec_from_hf


def qwen2_5_vl(hf: dict[str, Any], weights_only: bool = False):
    """``Qwen2_5_VLForConditionalGeneration``: a Qwen2 language model (its fields in ``text_config`` in
    transformers 5, at the top level in older checkpoints) with multimodal RoPE, and the vision tower."""
    text = {**hf, **{k: v for k, v in (hf.get("text_config") or {}).items() if v is not None}}
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.get("mrope_section")
    if not section:
        raise UnsupportedModelError("Qwen2.5-VL config without rope mrope_section; the language model's multimodal "
                                    "RoPE needs it")
    theta = rope.get("rope_theta", text.get("rope_theta", 1000000.0))
    text.update(rope_parameters={"rope_type": "default", "rope_theta": theta}, rope_scaling=None,
                architectures=hf["architectures"], tie_word_embeddings=hf.get("tie_word_embeddings", False))
    spec = qwen2(text, weights_only)
    return dataclasses.replace(spec, config={**spec.config, "mrope_section": list(section)},
                               vision=vision_spec_from_hf(hf))


def _sequence_classifier(causal_lm: Callable[..., ModelSpec]) -> Callable[..., ModelSpec]:
    """The adapter of ``causal_lm``'s ``*ForSequenceClassification`` twin: the same trunk, the score
    head in the LM head's place (never tied to the embedding: it has no vocabulary)."""

    def adapter(hf: HFConfig, weights_only: bool = False) -> ModelSpec:
        return dataclasses.replace(causal_lm(hf, weights_only), tie_word_embeddings=False,
                                   score_head=score_head_from_hf(hf))

    return adapter


# Each adapter takes the config and ``weights_only`` (see ``forward_only``).
ARCHITECTURES: dict[str, Callable[..., ModelSpec]] = {
    "LlamaForCausalLM": llama,
    "Qwen2ForCausalLM": qwen2,
    "Qwen3ForCausalLM": qwen3,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "MixtralForCausalLM": mixtral,
    "DeepseekV3ForCausalLM": deepseek_v3,
    "Qwen2_5_VLForConditionalGeneration": qwen2_5_vl,
    "LlamaForSequenceClassification": _sequence_classifier(llama),
    "Qwen2ForSequenceClassification": _sequence_classifier(qwen2),
    "Qwen3ForSequenceClassification": _sequence_classifier(qwen3),
}


def read_hf_config(source: Union[str, Path, HFConfig, Any]) -> HFConfig:
    """A config dict from a checkpoint directory, a config.json path, a dict or a transformers config."""
    if isinstance(source, dict):
        return source
    if hasattr(source, "to_dict"):
        return source.to_dict()
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no HF config at {path}; pass a checkpoint directory or its config.json")
    return json.loads(path.read_text())


MTP_MODES = ("auto", "on", "off")


def model_spec_from_hf(source: Union[str, Path, HFConfig, Any], *, mtp: str = "auto",
                       weights_only: bool = False) -> ModelSpec:
    """The ``ModelSpec`` of an HF checkpoint (a causal LM, or a sequence classifier such as a reward
    model); unknown architectures list the supported ones.

    ``mtp`` (multi-token-prediction layers that config.json announces, DeepSeek-V3): ``on`` builds
    them, ``off`` does not (their weights, if any, are left unread), ``auto`` builds them when
    ``source`` is a checkpoint directory whose weights hold them, or holds no weights at all, and
    otherwise builds without them, saying so in ``spec.notes``. ``weights_only``: settings that only
    the forward pass uses are not refused (``forward_only``); conversion, never training.
    """
    if mtp not in MTP_MODES:
        raise UnsupportedModelError(f"mtp={mtp!r} is not one of {', '.join(MTP_MODES)}")
    hf = read_hf_config(source)
    names = hf.get("architectures") or []
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {names or 'missing'} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    hf, notes, unused = _resolve_mtp(hf, source, mtp)
    spec = ARCHITECTURES[names[0]](hf, weights_only)
    return dataclasses.replace(spec, notes=notes, unused_hf_prefixes=unused) if notes or unused else spec


def hf_weight_names(directory: Union[str, Path]) -> set[str] | None:
    """Tensor names of the safetensors checkpoint in ``directory`` (read from the index or the file
    header, no weights), or None when it holds no weights (a config.json only)."""
    directory = Path(directory)
    index, single = directory / "model.safetensors.index.json", directory / "model.safetensors"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, "pt") as handle:
            return set(handle.keys())
    return None


def _resolve_mtp(hf: HFConfig, source, mode: str) -> tuple[HFConfig, tuple[str, ...], tuple[str, ...]]:
    """(config as built, notes, HF name prefixes left unread) for ``mode``; only configs announcing
    MTP layers (``num_nextn_predict_layers``) change."""
    field = "num_nextn_predict_layers" if "num_nextn_predict_layers" in hf else "num_mtp_layers"
    announced, layers = hf.get(field) or 0, hf.get("num_hidden_layers", 0)
    if not announced or mode == "on":
        return hf, (), ()
    prefixes = tuple(f"model.layers.{layers + k}." for k in range(announced))
    weights = hf_weight_names(source) if isinstance(source, (str, Path)) and Path(source).is_dir() else None
    present = weights is not None and any(name.startswith(prefixes) for name in weights)
    if mode == "auto" and (weights is None or present):
        return hf, (), ()
    without = dict(hf, **{field: 0})
    if mode == "off":
        return without, (), prefixes if present else ()
    note = (f"config.json says {field}={announced}, but {source} holds no MTP weights ({prefixes[0]}*, as "
            "transformers' save_pretrained writes it): building without MTP (mtp=auto; on / off decide)")
    return without, (note,), ()

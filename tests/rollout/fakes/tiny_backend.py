"""What both fakes compute with: a transformers model that decodes one request at a time on CPU.

It reproduces the engine behaviour the adapters depend on, which each fake configures: which tokens
stop a request, whether the stop tokens are tested before the length limit (an abort before both), and
which distribution the returned log-probs are taken from, and a prefix cache that serves stale KV until dropped. Greedy picks the argmax (lowest id on ties),
like both engines. ``routed_experts`` is what both engines' capturers hold for a sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from rlmega.bridge.fp8 import dequantize_blockwise
from rlmega.rollout.fp8_weights import is_fp8_checkpoint, load_fp8_checkpoint
from rlmega.rollout.hf_weights import HFWeightMap


def _auto_class(path: str | Path):
    """A causal LM's class, or a vision-language model's (Qwen2.5-VL): its text decoder answers token ids alone."""
    config = AutoConfig.from_pretrained(path)
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


class TinyCausalLM:
    """A checkpoint's model with the engines' ``load_weights(iterable of (on-disk name, tensor))``."""

    def __init__(self, path: str | Path):
        if is_fp8_checkpoint(path):
            self.model = load_fp8_checkpoint(path, _auto_class(path), torch.float32,
                                             attn_implementation="eager").eval().requires_grad_(False)
        else:
            self.model = _auto_class(path).from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval().requires_grad_(False)
        self.weight_map = HFWeightMap(self.model)
        # A block-FP8 checkpoint's linear layers, as both engines build them: an FP8 weight parameter
        # (vllm 0.33 quantization/utils/fp8_utils.py:1376 create_fp8_weight_parameter) and fp32 scales
        # [ceil(out/128), ceil(in/128)] named weight_scale_inv (fp8_utils.py:1396, quantization/fp8.py:339;
        # sglang 0.5.23 srt/layers/quantization/fp8.py:689). Their loaders copy what they are given into these
        # (vllm model_executor/parameter.py:95 ``self.data.copy_(loaded_weight)``): a wider tensor is cast to
        # FP8 as it is, unscaled. The model computes with fp8 x scales.
        self.fp8_parts: dict[str, list[torch.Tensor]] = {}
        for file in Path(path).glob("*.safetensors") if is_fp8_checkpoint(path) else ():
            tensors = load_file(file)
            self.fp8_parts.update({name: [tensor, tensors[name + "_scale_inv"]] for name, tensor in tensors.items()
                                   if name + "_scale_inv" in tensors})
        self.loaded: list[str] = []  # every name load_weights received, in order
        # The engines' prefix cache, coarsely: a greedy request whose prompt was seen is answered from the KV of
        # that time (here: its result), whatever the weights are now, until the engine drops the cache.
        self.prefix_cache: dict[tuple, tuple[list[int], list[float], str]] = {}

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            weight_name = name.removesuffix("_scale_inv")
            if weight_name in self.fp8_parts:
                part = self.fp8_parts[weight_name][int(name != weight_name)]
                assert part.shape == tensor.shape, f"{name}: {tensor.shape}"  # their weight_loader
                part.copy_(tensor)
                name, tensor = weight_name, dequantize_blockwise(*self.fp8_parts[weight_name])
            elif name not in self.weight_map.slots and name != "lm_head.weight":
                raise KeyError(name)  # what the engines' loaders raise (params_dict[name])
            target = self.weight_map.resolve(name)
            param = self.weight_map.tensors[target.tensor_name]
            assert param.data[target.index].shape == tensor.shape, f"{name}: {tensor.shape}"  # their weight_loader
            param.data[target.index].copy_(tensor)
            self.loaded.append(name)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.weight_map.tensors.values())

    @property
    def num_experts(self) -> int:
        config = self.model.config
        return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0

    @torch.no_grad()
    def routed_experts(self, tokens: list[int]) -> np.ndarray:
        """``[len(tokens), num_hidden_layers, num_experts_per_tok]`` int32, as both engines' capture buffers
        hold it: each MoE layer's top-k ids at its decoder-layer index, zeros in a dense layer's column
        (never written). Read by hooks on the gates of one pass over ``tokens``."""
        config = self.model.config
        captured = np.zeros((len(tokens), config.num_hidden_layers, config.num_experts_per_tok), dtype=np.int32)
        handles = []
        for index, layer in enumerate(self.model.model.layers):
            if hasattr(layer.mlp, "experts"):
                def hook(module, inputs, output, index=index):
                    captured[:, index] = output[2].numpy()  # (router logits, weights, expert ids)
                handles.append(layer.mlp.gate.register_forward_hook(hook))
        try:
            self.model(torch.tensor([tokens]))
        finally:
            for handle in handles:
                handle.remove()
        return captured

    @torch.no_grad()
    def decode(self, prompt: list[int], *, max_tokens: int, stop_ids: set[int], temperature: float, top_k: int,
               top_p: float, seed: int | None, logprobs_of: str, stop_first: bool,
               aborted: Callable[[], bool] = lambda: False) -> tuple[list[int], list[float], str]:
        """Sample one response. ``top_k <= 0`` disables top-k. ``logprobs_of``: which distribution the
        log-probs are taken from: ``raw`` logits, ``scaled`` by the temperature (SGLang's default when
        sampling), or ``processed``: scaled, then top-k / top-p masked and renormalised (vLLM's
        ``processed_logprobs``). ``aborted()`` is asked after each token, before the stop and length rules
        (SGLang's Req.update_finish_state: an aborted running request ends after one more decoding step).
        ``stop_first``: a stop token drawn as the last allowed token is "stop", not "length" (both engines' rule
        ``stop_tokens_before_length`` in api/rules.json, which each fake passes)."""
        key = (tuple(prompt), max_tokens, frozenset(stop_ids), temperature, logprobs_of)
        greedy = temperature == 0 or top_k == 1
        if greedy and key in self.prefix_cache:
            return self.prefix_cache[key]  # its KV was computed with the weights of that time
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        tokens: list[int] = []
        logprobs: list[float] = []
        while True:
            logits = self.model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            source = logits
            if greedy:  # (vLLM's processed log-probs of top_k=1 at a temperature > 0: fake_vllm)
                token = int(logits.argmax())
            else:
                scaled = logits / temperature
                if 0 < top_k < scaled.numel():
                    scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
                probs = torch.softmax(scaled, dim=-1)
                sorted_probs, order = probs.sort(descending=True)
                sorted_probs[(sorted_probs.cumsum(0) - sorted_probs) > top_p] = 0.0
                token = int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
                if logprobs_of == "scaled":
                    source = logits / temperature
                elif logprobs_of == "processed":
                    kept = torch.zeros_like(probs).scatter(0, order, sorted_probs)
                    source = torch.where(kept > 0, scaled, torch.full_like(scaled, float("-inf")))
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(source, dim=-1)[token]))
            if aborted():
                return tokens, logprobs, "abort"
            stopped, capped = token in stop_ids, len(tokens) >= max_tokens
            reason = ("stop" if stopped else "length" if capped else None) if stop_first else \
                ("length" if capped else "stop" if stopped else None)
            if reason is not None:
                if greedy:
                    self.prefix_cache[key] = tokens, logprobs, reason
                return tokens, logprobs, reason

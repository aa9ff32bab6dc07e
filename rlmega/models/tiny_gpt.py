"""A tiny Megatron GPT (RMSNorm, SwiGLU, RoPE, GQA; optionally MoE) trained through Megatron's
own schedules, DDP and optimizer. Used by `rlmega smoke`, tests and benchmarks to exercise the real
engine on CPU in any parallel layout.

Weights, gradients and parameters cross layouts through Megatron's dist_checkpointing, which
reshards between any TP/PP/VPP/EP layout; ``read_checkpoint`` flattens a checkpoint to full
tensors without a process group, for comparisons.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import torch

from rlmega.models import ModelSpec, build_chunks, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout

# A multiple of Megatron's vocabulary padding (rlmega.models.spec.VOCAB_PAD_MULTIPLE), so no
# padding columns exist and LM losses (which would include padding logits) compare exactly
# across tensor-parallel sizes.
VOCAB_SIZE = 1024
SEQ_LEN = 16


@dataclasses.dataclass(frozen=True)
class TinyGPTSpec:
    """Shape of the tiny model; the defaults keep a forward pass in milliseconds on CPU."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 64
    sequence_parallel: bool = False
    """Shard activations along the sequence between TP ranks (needs tp > 1; required for MoE with tp > 1)."""

    def model_spec(self) -> ModelSpec:
        """The same model as an HF architecture would describe it: Llama, or Mixtral with experts."""
        hf = dict(
            architectures=["MixtralForCausalLM" if self.num_experts else "LlamaForCausalLM"],
            vocab_size=VOCAB_SIZE, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_query_groups,
            intermediate_size=self.moe_ffn_hidden_size if self.num_experts else self.ffn_hidden_size,
            max_position_embeddings=SEQ_LEN, rms_norm_eps=1e-5, tie_word_embeddings=False,
        )
        if self.num_experts:
            hf.update(num_local_experts=self.num_experts, num_experts_per_tok=self.moe_router_topk)
        return model_spec_from_hf(hf)

    def check_layout(self, layout: ParallelLayout) -> None:
        """Raise LayoutError unless this model can be split as ``layout`` says."""
        self.model_spec().check_layout(layout)


def build_model(spec: TinyGPTSpec, layout: ParallelLayout, seed: int = 1234) -> list:
    """Model chunks (one per virtual stage) wrapped in Megatron's DDP, on this rank."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    model_spec = spec.model_spec()
    config = model_spec.transformer_config(layout, sequence_parallel=spec.sequence_parallel, init_method_std=0.02)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    chunks = [DistributedDataParallel(config, ddp_config, model) for model in build_chunks(model_spec, layout, config)]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in chunks] if len(chunks) > 1 else chunks[0].no_sync
    return chunks


def build_optimizer(chunks: list, lr: float = 1e-2, adam_eps: float = 1e-8):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=lr, adam_eps=adam_eps, weight_decay=0.01, clip_grad=1.0, bf16=False, fp16=False,
        use_distributed_optimizer=False,
    )
    return get_megatron_optimizer(config, chunks)


def make_batches(num_microbatches: int, micro_batch_size: int, seed: int = 7) -> list[dict]:
    """Identical random token batches on every rank (same seed), one dict per micro-batch."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, VOCAB_SIZE, (micro_batch_size, SEQ_LEN + 1), generator=generator)
        batches.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return batches


def make_counting_batches(num_microbatches: int, micro_batch_size: int, seed: int = 7) -> list[dict]:
    """Arithmetic sequences modulo 256 (random start and stride): a task the tiny model learns in a
    few dozen steps, so a falling loss shows that training works."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_microbatches):
        start = torch.randint(0, 256, (micro_batch_size, 1), generator=generator)
        stride = torch.randint(1, 4, (micro_batch_size, 1), generator=generator)
        tokens = (start + stride * torch.arange(SEQ_LEN + 1)) % 256
        batches.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return batches


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    # Megatron averages the returned loss over micro-batches; this is the mean over one.
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}  # Megatron rescales `loss` in place


def _forward_step(data_iterator: Iterator, model):
    batch = next(data_iterator)
    tokens = batch["tokens"]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    output = model(tokens, positions, None, labels=batch["labels"])
    return output, functools.partial(_loss_func, torch.ones_like(batch["labels"], dtype=torch.float))


def zero_grads(chunks: list, optimizer=None) -> None:
    """Clear the DDP gradient buffers and the optimizer's ``param.grad`` views of them.

    Both are needed: after a step ``param.grad`` aliases the buffer, and autograd would accumulate
    into it on top of DDP's own accumulation.
    """
    for chunk in chunks:
        chunk.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()


def forward_backward(chunks: list, batches: list[dict], forward_only: bool = False) -> Optional[float]:
    """One pass of Megatron's schedule over ``batches``; the mean loss on the last stage, else None.

    Gradients accumulate: call ``zero_grads`` first to start a new step.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    iterators = [iter(batches) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches),
        seq_length=SEQ_LEN,
        micro_batch_size=batches[0]["tokens"].shape[0],
        forward_only=forward_only,
    )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return float(sum(item["lm loss"] for item in losses) / len(losses))


def train_step(chunks: list, optimizer, batches: list[dict]) -> tuple[Optional[float], float]:
    """Zero, forward-backward, optimizer step: (mean loss on the last stage or None, grad norm)."""
    zero_grads(chunks, optimizer)
    loss = forward_backward(chunks, batches)
    _, grad_norm, _ = optimizer.step()
    return loss, grad_norm


def _sharded_state_dict(chunks: list) -> dict:
    if len(chunks) == 1:
        return chunks[0].module.sharded_state_dict()
    state = {}
    for index, chunk in enumerate(chunks):
        state[f"model{index}"] = chunk.module.sharded_state_dict()
    return state


def save_weights(chunks: list, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    Path(directory).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(_sharded_state_dict(chunks), str(directory))


def load_weights(chunks: list, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(_sharded_state_dict(chunks), str(directory))
    if len(chunks) == 1:
        chunks[0].module.load_state_dict(state)
    else:
        for index, chunk in enumerate(chunks):
            chunk.module.load_state_dict(state[f"model{index}"])


@contextlib.contextmanager
def _grads_as_params(chunks: list):
    """Temporarily show each parameter's accumulated gradient in place of its value."""
    swapped = []
    for chunk in chunks:
        for param in chunk.module.parameters():
            grad = param.main_grad if hasattr(param, "main_grad") else param.grad
            swapped.append((param, param.data))
            param.data = grad.detach().clone()
    try:
        yield
    finally:
        for param, value in swapped:
            param.data = value


def save_grads(chunks: list, directory: Path) -> None:
    """Save gradients with the parameters' sharding, so any layout can be compared with any other."""
    with _grads_as_params(chunks):
        save_weights(chunks, directory)


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, unsharded; no process group needed."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        flat = Path(scratch) / "flat.pt"
        dcp_to_torch_save(str(directory), str(flat))
        state = torch.load(flat, weights_only=False)
    return {key: value for key, value in state.items() if torch.is_tensor(value)}

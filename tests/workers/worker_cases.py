"""Shared pieces of the worker tests: a batch of variable-length sequences and HF references."""

import torch
from transformers import AutoModelForCausalLM

from hf_models import VOCAB
from rlmega.workers.batching import SequenceBatch

LENGTHS = [(3, 9), (2, 5), (4, 12), (2, 7), (5, 10), (3, 6)]  # (prompt, total)


def make_batch(seed: int = 5, lengths=LENGTHS) -> SequenceBatch:
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (total,), generator=generator) for _, total in lengths]
    return SequenceBatch(tokens, [prompt for prompt, _ in lengths])


def hf_logprobs(hf_dir, batch: SequenceBatch):
    """Per sequence, (log-probs, entropies) of the response tokens under the HF model, in fp32."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    logprobs, entropies = [], []
    with torch.no_grad():
        for tokens, prompt in zip(batch.tokens, batch.prompt_lengths):
            log_softmax = torch.log_softmax(model(tokens.unsqueeze(0)).logits[0].float(), dim=-1)[prompt - 1:-1]
            logprobs.append(log_softmax.gather(-1, tokens[prompt:].unsqueeze(-1))[:, 0])
            entropies.append(-(log_softmax.exp() * log_softmax).sum(-1))
    return logprobs, entropies


def saved_model_keys(iteration_dir) -> set[str]:
    """The model's keys in a saved checkpoint: not the optimizer's, the RNG's or the step's, nor Megatron's common
    state (a key of its own in the files from megatron-core 0.19)."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(iteration_dir)).read_metadata().state_dict_metadata
    return {key for key in saved if not key.startswith(("optimizer", "rng", "step", "extra", "common_state"))}

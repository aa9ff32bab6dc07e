"""Tiny random HF sequence-classification reward models (``score`` head, num_labels=1), saved as real
checkpoints, and transformers' own scores of them."""

import torch
from transformers import AutoModelForSequenceClassification

from hf_models import CONFIGS, VOCAB

PAD = VOCAB - 1
"""The pad token of the checkpoints saved with a pad token."""


def save_tiny_reward_model(name: str, directory, pad_token_id=PAD, seed: int = 0) -> None:
    """A ``*ForSequenceClassification`` twin of ``hf_models.CONFIGS[name]``, random, fp32."""
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    config.num_labels, config.pad_token_id = 1, pad_token_id
    config._attn_implementation = "eager"
    model = AutoModelForSequenceClassification.from_config(config).float().eval()
    with torch.no_grad():  # random small norms/biases, so a dropped or swapped one shows in the scores
        for pname, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in pname else 0.1 * torch.randn_like(param))
        model.score.weight.normal_(0.0, 0.5)  # scores of order 1, not 0.02's
    model.save_pretrained(directory)


def load(directory):
    return AutoModelForSequenceClassification.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()


def hf_scores(directory, sequences: list[torch.Tensor]) -> torch.Tensor:
    """``[B]`` transformers' pooled logits: one right-padded batch with its attention mask when the
    config has a pad token, else one sequence at a time (the only batch it takes without one)."""
    model = load(directory)
    pad = model.config.pad_token_id
    with torch.no_grad():
        if pad is None:
            return torch.cat([model(seq.unsqueeze(0)).logits[:, 0] for seq in sequences])
        width = max(seq.numel() for seq in sequences)
        tokens = torch.full((len(sequences), width), pad, dtype=torch.long)
        mask = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, seq in enumerate(sequences):
            tokens[row, :seq.numel()], mask[row, :seq.numel()] = seq, 1
        return model(tokens, attention_mask=mask).logits[:, 0]


def hf_token_scores(directory, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, S, 1]``: the score head on every position's final hidden state (unpooled)."""
    model = load(directory)
    with torch.no_grad():
        return model.score(model.model(tokens).last_hidden_state)

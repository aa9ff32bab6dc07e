"""The quickstart's tiny reward model (``configs/tiny_cpu_rm.yaml``): a ``LlamaForSequenceClassification``
of the tiny policy's shape and with its tokenizer, fit on CPU at the run's set-up to the rule reward of the
arithmetic task, so that a run scored by it alone can learn.

Training, from random weights: each step takes 32 training prompts, each with its right answer and 3
wrong ones (other numbers of the answers' range, and malformed strings with and without the end-of-text
token), labelled by the rule scorer itself, and applies a listwise loss: the softmax over a prompt's
candidates' scores should pick the right one (a Bradley-Terry loss over more than two). An auxiliary
linear probe reads the right answer from the first layer's output at the scored position (it is
dropped afterwards): the sum is learnt from every sequence, so the second layer only has to compare it
with the response, and the fit takes a few hundred steps instead of thousands. Measured: see
rlmega/trainer/README.md (Reward models). Built once per directory, like ``assets.py`` builds the policy.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Sequence

from rlmega.trainer.assets import TINY_MODEL

MALFORMED_ALPHABET = "0123456789+-=* "


def prepare_tiny_reward_model(directory: str | os.PathLike, *, policy_dir: str | os.PathLike,
                              train_files: Sequence[str], steps: int = 600, prompts_per_step: int = 32,
                              negatives: int = 4, seed: int = 0) -> str:
    """Fit (if missing) the tiny reward model into ``directory`` (HF checkpoint + the policy's tokenizer)
    on the prompts of ``train_files`` (arithmetic rows) rendered by ``policy_dir``'s tokenizer; returns
    the directory. Writes to a temporary name and renames when complete."""
    import time

    import torch

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return str(directory)
    started, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: one thread is as fast, and a shared machine stays usable
    try:
        model, tokenizer = _fit(policy_dir, train_files, steps, prompts_per_step, negatives, seed)
    finally:
        torch.set_num_threads(threads)
    staging = directory.with_name(directory.name + ".tmp")
    model.eval().save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.replace(staging, directory)
    print(f"fit the tiny reward model in {time.perf_counter() - started:.0f} s", flush=True)
    return str(directory)


def _fit(policy_dir, train_files: Sequence[str], steps: int, prompts_per_step: int, negatives: int, seed: int):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    prompts = _prompts(tokenizer, train_files)
    answers = sorted({int(truth) for _, truth in prompts})
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, num_labels=1,
                         **TINY_MODEL)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config).float().train()
    probe = torch.nn.Linear(config.hidden_size, answers[-1] + 1)
    parameters = list(model.parameters()) + list(probe.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps,
                                                   pct_start=max(0.1, 2 / steps))  # warm-up of >= 2 steps
    rng = random.Random(seed)
    for _ in range(steps):
        batch = rng.sample(prompts, prompts_per_step)
        sequences = [candidate for prompt, truth in batch
                     for candidate in _candidates(tokenizer, prompt, truth, answers, negatives, rng)]
        tokens, mask = _right_padded(sequences, tokenizer.pad_token_id)
        out = model.model(input_ids=tokens, attention_mask=mask, output_hidden_states=True)
        rows, last = torch.arange(len(sequences)), mask.sum(-1) - 1
        scores = model.score(out.last_hidden_state[rows, last])[:, 0].view(prompts_per_step, negatives + 1)
        ranking = torch.nn.functional.cross_entropy(scores, torch.zeros(prompts_per_step, dtype=torch.long))
        truths = torch.tensor([int(truth) for _, truth in batch]).repeat_interleave(negatives + 1)
        sums = torch.nn.functional.cross_entropy(probe(out.hidden_states[1][rows, last]), truths)
        optimizer.zero_grad()
        (ranking + sums).backward()
        optimizer.step()
        schedule.step()
    return model, tokenizer


def _prompts(tokenizer, train_files: Sequence[str]) -> list[tuple[list[int], str]]:
    """(prompt token ids, ground truth) of every distinct training prompt."""
    from rlmega.data import DataConfig, PromptDataset

    records = PromptDataset(DataConfig(files=list(train_files)), tokenizer).records
    return list({tuple(r.prompt_token_ids): (list(r.prompt_token_ids), str(r.ground_truth)) for r in records}.values())


def _candidates(tokenizer, prompt: list[int], truth: str, answers: list[int], negatives: int,
                rng: random.Random) -> list[list[int]]:
    """The right answer first, then ``negatives`` responses the rule scores 0: wrong numbers, and one
    malformed string (cut at the length limit, without the end-of-text token, when it is 4 long)."""
    from rlmega.rewards import arithmetic_score

    eos = [tokenizer.eos_token_id]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    candidates = [prompt + encode(truth) + eos]
    while len(candidates) < negatives + 1:
        if len(candidates) < negatives:
            text, end = str(rng.choice(answers)), eos
        else:
            length = rng.randint(1, 4)
            text = "".join(rng.choice(MALFORMED_ALPHABET) for _ in range(length))
            end = [] if length == 4 else eos
        if arithmetic_score(text, truth) == 0.0 and encode(text):
            candidates.append(prompt + encode(text) + end)
    return candidates


def _right_padded(sequences: list[list[int]], pad: int):
    import torch

    width = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        tokens[row, :len(sequence)] = torch.tensor(sequence)
        mask[row, :len(sequence)] = 1
    return tokens, mask

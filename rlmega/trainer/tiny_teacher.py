"""The quickstart's tiny teacher for on-policy distillation: a 4-layer ``LlamaForCausalLM`` of the tiny policy's
width and with its tokenizer (so the vocabularies are the same, as distillation needs), trained on CPU at the
run's set-up by plain supervised learning on the training prompts and their right answers until it solves the
arithmetic task; its greedy accuracy on the validation file is measured and printed.

Training, from random weights: each step takes ``batch_size`` (prompt, answer) pairs drawn from the distinct
training prompts, and minimises the negative log-likelihood of the answer's tokens and the end-of-text token
(the prompt's tokens are not trained on), with AdamW under a one-cycle schedule. Seeded: the same files give
the same teacher. Built once per directory, like ``assets.py`` builds the policy.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Sequence

from rlmega.trainer.assets import TINY_MODEL, save_quietly

TEACHER_LAYERS = 4
MAX_ANSWER_TOKENS = 4


def prepare_tiny_teacher(directory: str | os.PathLike, *, policy_dir: str | os.PathLike, train_files: Sequence[str],
                         val_files: Sequence[str] = (), steps: int = 200, batch_size: int = 64,
                         seed: int = 0) -> str:
    """Train (if missing) the tiny teacher into ``directory`` (HF checkpoint + the policy's tokenizer) on the
    arithmetic rows of ``train_files`` rendered by ``policy_dir``'s tokenizer, print its greedy accuracy on
    ``val_files`` (when given), and return the directory. Writes to a temporary name and renames when complete."""
    import torch

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return str(directory)
    started, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: one thread is as fast, and a shared machine stays usable
    try:
        model, tokenizer = _train(policy_dir, train_files, steps, batch_size, seed)
        accuracy = greedy_accuracy(model, tokenizer, val_files) if val_files else None
    finally:
        torch.set_num_threads(threads)
    staging = directory.with_name(directory.name + ".tmp")
    save_quietly(model.eval(), staging)
    tokenizer.save_pretrained(staging)
    os.replace(staging, directory)
    measured = f", greedy accuracy {accuracy:.1%} on the validation prompts" if accuracy is not None else ""
    print(f"trained the tiny teacher in {time.perf_counter() - started:.0f} s{measured}", flush=True)
    return str(directory)


def _train(policy_dir, train_files: Sequence[str], steps: int, batch_size: int, seed: int):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    examples = _examples(tokenizer, train_files)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **{**TINY_MODEL, "num_hidden_layers": TEACHER_LAYERS})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps,
                                                   pct_start=max(0.1, 2 / steps))  # warm-up of >= 2 steps
    rng = random.Random(seed)
    for _ in range(steps):
        tokens, mask, labels = _right_padded(rng.choices(examples, k=batch_size), tokenizer.pad_token_id)
        loss = model(input_ids=tokens, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return model.eval(), tokenizer


def _examples(tokenizer, files: Sequence[str]) -> list[tuple[list[int], list[int], str]]:
    """(prompt token ids, answer token ids with end-of-text, ground truth) of every distinct prompt of ``files``."""
    from rlmega.data import DataConfig, PromptDataset

    records = PromptDataset(DataConfig(files=list(files)), tokenizer).records
    end = [tokenizer.eos_token_id]
    return list({tuple(r.prompt_token_ids): (list(r.prompt_token_ids),
                                             tokenizer.encode(str(r.ground_truth), add_special_tokens=False) + end,
                                             str(r.ground_truth))
                 for r in records}.values())


def _right_padded(examples: list[tuple[list[int], list[int], str]], pad: int):
    """Token ids, attention mask and labels (the answer's tokens; -100 elsewhere) ``[B, S]``."""
    import torch

    width = max(len(prompt) + len(answer) for prompt, answer, _ in examples)
    tokens = torch.full((len(examples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (prompt, answer, _) in enumerate(examples):
        sequence = prompt + answer
        tokens[row, :len(sequence)] = torch.tensor(sequence)
        mask[row, :len(sequence)] = 1
        labels[row, len(prompt):len(sequence)] = torch.tensor(answer)
    return tokens, mask, labels


def greedy_accuracy(model, tokenizer, files: Sequence[str]) -> float:
    """The share of the distinct prompts of ``files`` whose greedy answer (at most ``MAX_ANSWER_TOKENS`` tokens, to
    the end-of-text token) the rule scores right."""
    import torch

    from rlmega.rewards import arithmetic_score

    examples = _examples(tokenizer, files)
    right = 0
    with torch.no_grad():
        for prompt, _, truth in examples:
            sequence = list(prompt)
            for _ in range(MAX_ANSWER_TOKENS):
                token = int(model(torch.tensor([sequence])).logits[0, -1].argmax())
                if token == tokenizer.eos_token_id:
                    break
                sequence.append(token)
            right += arithmetic_score(tokenizer.decode(sequence[len(prompt):]), truth) == 1.0
    return right / len(examples)

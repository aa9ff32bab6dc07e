"""The checks of the ``teacher:`` section (on-policy distillation's frozen teacher models).

``teacher_problems`` reads the settings alone (before any file the run builds itself exists);
``check_teacher_inputs`` reads each teacher's checkpoint and tokenizer: a causal LM that fits its layout,
with the student's vocabulary. Distillation compares the two models token by token, so a teacher that
splits text into other tokens (or numbers them otherwise) is refused: cross-tokenizer distillation is
not supported.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from rlmega.config.frozen_checkpoint import frozen_checkpoint_problem

DTYPES = (None, "bf16", "fp32")
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _sections(config) -> list[tuple[str, Any]]:
    """(dotted name, ``TeacherModelConfig``) of every teacher the run starts."""
    return [("teacher" if source is None else f"teacher.per_data_source.{source}", settings)
            for source, settings in config.teacher.models().items()]


def teacher_problems(config) -> list[tuple[str, str]]:
    """(field, what is wrong and how to fix it) for each setting of an enabled ``teacher`` that cannot work."""
    teacher = config.teacher
    if not teacher.enable:
        return [("tiny_teacher", "trains a teacher that nothing uses; set teacher.enable=true (with teacher.path "
                                 "where it goes) or tiny_teacher=false")] if config.tiny_teacher else []
    problems = []
    if not config.algorithm.distill.enabled:
        problems.append(("teacher.enable", "starts a teacher that nothing uses: algorithm.distill.coef is 0; set "
                                           "algorithm.distill.coef > 0 to distill from it, or teacher.enable=false"))
    if type(teacher.top_k) is not int or teacher.top_k < 0:
        problems.append(("teacher.top_k", f"must be an int >= 0 (0: the sampled tokens' log-probs only), "
                                          f"got {teacher.top_k!r}"))
    for section, settings in _sections(config):
        if not settings.path:
            problems.append((f"{section}.path", "no checkpoint given; set it to the teacher's HF checkpoint directory"))
        if not settings.cpus_per_rank > 0:
            problems.append((f"{section}.cpus_per_rank", f"must be > 0, got {settings.cpus_per_rank}"))
        if settings.gpus_per_rank < 0:
            problems.append((f"{section}.gpus_per_rank", f"must be >= 0, got {settings.gpus_per_rank}"))
        if settings.dtype not in DTYPES:
            problems.append((f"{section}.dtype", f"{settings.dtype!r} is not one of bf16, fp32 (or null: bf16 with "
                                                 "CUDA, fp32 on CPU)"))
        if type(settings.max_tokens_per_microbatch) is not int or settings.max_tokens_per_microbatch < 1:
            problems.append((f"{section}.max_tokens_per_microbatch",
                             f"must be an int >= 1, got {settings.max_tokens_per_microbatch!r}"))
    return problems


def check_teacher_inputs(config, error: type[Exception]) -> None:
    """Raise ``error`` naming the first teacher whose checkpoint, layout or tokenizer cannot serve the run."""
    from transformers import AutoTokenizer

    if not config.teacher.enable:
        return
    student_source = config.model.tokenizer_path or config.model.path
    student = AutoTokenizer.from_pretrained(student_source)
    for section, settings in _sections(config):
        problem = frozen_checkpoint_problem(section, settings.path, settings.layout, "teacher")
        if problem:
            raise error(f"{problem[0]}: {problem[1]}")
        field = f"{section}.tokenizer_path" if settings.tokenizer_path else f"{section}.path"
        source = settings.tokenizer_path or settings.path
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as problem:
            raise error(f"{field}: no tokenizer loads from {source} ({str(problem).splitlines()[0]})") from None
        difference = vocabulary_difference(tokenizer, student)
        if difference is not None:
            raise error(f"{field}: cross-tokenizer distillation is not supported: the teacher's tokenizer ({source}) "
                        f"differs from the student's ({student_source}): {difference}; give the teacher a "
                        "tokenizer with the student's vocabulary and special tokens")


def vocabulary_difference(tokenizer, other) -> Optional[str]:
    """None when ``tokenizer`` (the teacher's) and ``other`` (the student's) map the same tokens to the same ids
    and have the same special tokens; else the first difference in words (tokens in the order of their ids)."""
    mine, theirs = tokenizer.get_vocab(), other.get_vocab()

    def described(token_id: Optional[int], whose: str) -> str:
        return f"absent from the {whose}" if token_id is None else f"id {token_id} in the {whose}"

    if mine != theirs:
        order = lambda token: (min(mine.get(token, math.inf), theirs.get(token, math.inf)), token)  # noqa: E731
        token = next(t for t in sorted(set(mine) | set(theirs), key=order) if mine.get(t) != theirs.get(t))
        teacher_side, student_side = described(mine.get(token), "teacher's"), described(theirs.get(token), "student's")
        return f"the first differing token is {token!r} ({teacher_side}, {student_side})"
    for name in SPECIAL_TOKENS:
        if getattr(tokenizer, name, None) != getattr(other, name, None):
            return (f"the first differing token is the {name} ({getattr(tokenizer, name, None)!r} in the teacher's, "
                    f"{getattr(other, name, None)!r} in the student's)")
    return None

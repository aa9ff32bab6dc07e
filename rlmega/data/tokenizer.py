"""A character-level tokenizer built locally (no download) for the CPU quickstart and tests.

One token per printable ASCII character, tab and newline, plus special tokens; 104 tokens in all, so it fits the
256-token vocabulary of the tiny test models. It carries a chat template and saves with ``save_pretrained``, so
``AutoTokenizer.from_pretrained`` loads it like any Hugging Face tokenizer.

A user message ``1+2=`` renders as ``<bos><|user|>1+2=<eos><|assistant|>``; the assistant's reply ends with
``<eos>``.
"""

from __future__ import annotations

import os

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK) + ROLE_TOKENS
CHARACTERS = ("\t", "\n") + tuple(chr(code) for code in range(32, 127))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
"""Qwen2.5-VL's image markup, after the characters (so a text model's ids stay as they are)."""


def build_char_tokenizer(vision: bool = False):
    """The character tokenizer as a ``transformers.PreTrainedTokenizerFast`` (ids: specials first, then chars;
    with ``vision``, the image markup tokens of a vision-language model after them)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    extra = VISION_TOKENS if vision else ()
    vocab = {token: token_id for token_id, token in enumerate(SPECIAL_TOKENS + CHARACTERS + extra)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    # Raw text (no chat template) starts with BOS like the template does.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS + extra),
        clean_up_tokenization_spaces=False,
    )
    if vision:
        tokenizer.image_token, tokenizer.vision_start_token, tokenizer.vision_end_token = extra[1], extra[0], extra[2]
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_char_tokenizer(directory: str | os.PathLike) -> str:
    """Build the character tokenizer and ``save_pretrained`` it into ``directory``; returns the directory."""
    directory = os.fspath(directory)
    build_char_tokenizer().save_pretrained(directory)
    return directory

"""The synthetic arithmetic task and the locally built character tokenizer, end to end through the dataset."""

import pytest
from transformers import AutoTokenizer

from rlmega.data import (
    ARITHMETIC_DATA_SOURCE,
    DataConfig,
    PromptDataset,
    make_arithmetic_rows,
    read_rows,
    save_char_tokenizer,
    write_arithmetic_dataset,
)
from rlmega.data.tokenizer import SPECIAL_TOKENS


def test_arithmetic_rows_are_correct_and_seeded():
    rows = make_arithmetic_rows(50, seed=1, max_operand=9, operators="+-*")
    for row in rows:
        extra = row["extra_info"]
        a, b, operator = extra["a"], extra["b"], extra["operator"]
        assert row["prompt"] == [{"role": "user", "content": f"{a}{operator}{b}="}]
        assert row["reward_model"]["ground_truth"] == str({"+": a + b, "-": a - b, "*": a * b}[operator])
        assert row["data_source"] == ARITHMETIC_DATA_SOURCE and 0 <= a <= 9 and 0 <= b <= 9
    assert [row["extra_info"]["index"] for row in rows] == list(range(50))
    assert make_arithmetic_rows(50, seed=1, max_operand=9, operators="+-*") == rows
    assert make_arithmetic_rows(50, seed=2, max_operand=9, operators="+-*") != rows
    with pytest.raises(ValueError, match="operators must be drawn from"):
        make_arithmetic_rows(1, operators="/")


def test_saved_tokenizer_loads_with_auto_tokenizer_and_round_trips(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_char_tokenizer(tmp_path / "tok"))
    assert len(tokenizer) == 104 <= 256
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = "Compute 12 + 7 =\n\t{answer: 19}!"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer("é")["input_ids"], skip_special_tokens=True) == ""  # unknown -> <unk>
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == token_id


def test_arithmetic_dataset_through_the_local_tokenizer(tmp_path):
    path = write_arithmetic_dataset(tmp_path / "train.parquet", num_rows=20, seed=0)
    assert len(read_rows(path)) == 20
    tokenizer = AutoTokenizer.from_pretrained(save_char_tokenizer(tmp_path / "tok"))
    dataset = PromptDataset(DataConfig(files=[path], max_prompt_length=16), tokenizer)
    record = dataset[0]
    question = record.messages[0]["content"]
    assert tokenizer.decode(record.prompt_token_ids) == f"<bos><|user|>{question}<eos><|assistant|>"
    assert record.data_source == ARITHMETIC_DATA_SOURCE
    assert record.ground_truth == str(record.extra_info["a"] + record.extra_info["b"])
    answer_ids = tokenizer(record.ground_truth + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(answer_ids, skip_special_tokens=True) == record.ground_truth

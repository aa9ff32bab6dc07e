"""Reading verl-schema parquet/jsonl, the chat template, length limits and the errors that name the row."""

import json

import pytest

from rlmega.data import DataConfig, DataFormatError, PromptDataset, prompt_text, read_rows, write_rows

GSM8K_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 2+3? Let's think step by step."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"index": 0, "split": "train"},
    },
]
COUNTDOWN_ROWS = [
    {
        "data_source": "countdown",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Make 10 from 2 5."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": 10, "numbers": [2, 5]}},
        "extra_info": {"index": 1, "split": "train"},
    },
]


def _countdown_row(**overrides):
    row = {
        "data_source": "countdown",
        "prompt": "Make 10.",
        "reward_model": {"ground_truth": {"target": 10, "numbers": [2, 5]}},
    }
    row.update(overrides)
    return row


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("rows", [GSM8K_ROWS, COUNTDOWN_ROWS], ids=["gsm8k", "countdown"])
def test_round_trip_keeps_verl_rows(tmp_path, suffix, rows):
    path = write_rows(rows, tmp_path / f"train{suffix}")
    assert read_rows(path) == rows


def test_parquet_refuses_mixed_column_types_with_the_path(tmp_path):
    with pytest.raises(DataFormatError, match="mixed.parquet: the rows do not fit one parquet table"):
        write_rows(GSM8K_ROWS + COUNTDOWN_ROWS, tmp_path / "mixed.parquet")


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_dataset_records_from_verl_rows(tmp_path, suffix, char_tokenizer):
    gsm8k = write_rows(GSM8K_ROWS, tmp_path / f"gsm8k{suffix}")
    countdown = write_rows(COUNTDOWN_ROWS, tmp_path / f"countdown{suffix}")
    dataset = PromptDataset(DataConfig(files=[gsm8k, countdown], max_prompt_length=128), char_tokenizer)
    assert len(dataset) == 2 and dataset.data_sources == {"openai/gsm8k", "countdown"}
    first, second = dataset.batch([0, 1])
    assert first.ground_truth == "5" and first.reward_style == "rule"
    assert first.extra_info == {"index": 0, "split": "train"}
    assert second.ground_truth == {"target": 10, "numbers": [2, 5]}
    assert second.messages == COUNTDOWN_ROWS[0]["prompt"]
    assert (second.index, second.source_file, second.source_row) == (1, countdown, 0)
    expected = char_tokenizer.apply_chat_template(COUNTDOWN_ROWS[0]["prompt"], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    assert second.prompt_token_ids == expected
    assert char_tokenizer.decode(second.prompt_token_ids) == (
        "<bos><|system|>Be brief.<eos><|user|>Make 10 from 2 5.<eos><|assistant|>"
    )


def test_string_prompt_and_raw_text(tmp_path, char_tokenizer):
    path = write_rows([_countdown_row(prompt="1+2=")], tmp_path / "raw.jsonl")
    templated = PromptDataset(DataConfig(files=[path]), char_tokenizer)[0]
    assert templated.messages == [{"role": "user", "content": "1+2="}]
    assert char_tokenizer.decode(templated.prompt_token_ids) == "<bos><|user|>1+2=<eos><|assistant|>"
    raw = PromptDataset(DataConfig(files=[path], use_chat_template=False), char_tokenizer)[0]
    assert char_tokenizer.decode(raw.prompt_token_ids) == "<bos>1+2="


def test_raw_text_joins_message_contents(char_tokenizer):
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    assert prompt_text(messages, char_tokenizer, use_chat_template=False) == "a\nb"


def test_files_are_concatenated_in_order(tmp_path, char_tokenizer):
    first = write_rows([_countdown_row(prompt="x")], tmp_path / "a.parquet")
    second = write_rows([_countdown_row(prompt="y"), _countdown_row(prompt="z")], tmp_path / "b.jsonl")
    dataset = PromptDataset(DataConfig(files=[first, second]), char_tokenizer)
    assert [record.messages[0]["content"] for record in dataset.records] == ["x", "y", "z"]
    assert [record.index for record in dataset.records] == [0, 1, 2]
    assert [(record.source_file, record.source_row) for record in dataset.records] == [
        (first, 0), (second, 0), (second, 1)]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"data_source": "countdown", "reward_model": {"ground_truth": "1"}}, r"row 1: missing field\(s\) \['prompt'\]"),
        (_countdown_row(reward_model=None), r"row 1: missing field\(s\) \['reward_model'\]"),
        (_countdown_row(reward_model={"style": "rule"}), "row 1: missing field 'reward_model.ground_truth'"),
        (_countdown_row(reward_model="5"), "row 1: field 'reward_model' must be a mapping"),
        (_countdown_row(prompt=[{"role": "user"}]), r"row 1: field 'prompt\[0\].content' must be a string"),
        (_countdown_row(prompt=[]), "row 1: field 'prompt' must be a string or a non-empty list"),
        (_countdown_row(prompt=7), "row 1: field 'prompt' must be a string or a non-empty list"),
        (_countdown_row(data_source=3), "row 1: field 'data_source' must be a non-empty string"),
        (_countdown_row(extra_info=[1]), "row 1: field 'extra_info' must be a mapping"),
    ],
)
def test_schema_errors_name_file_row_and_field(tmp_path, char_tokenizer, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_countdown_row()) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataFormatError, match=f"bad.jsonl {message}"):
        PromptDataset(DataConfig(files=[str(path)]), char_tokenizer)


def test_bad_json_line_and_unknown_suffix_are_named(tmp_path, char_tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_countdown_row()) + "\n\n{oops\n")
    with pytest.raises(DataFormatError, match="bad.jsonl line 3: not valid JSON"):
        read_rows(path)
    with pytest.raises(DataFormatError, match=r"data.csv: unsupported file type; supported: \['.parquet', '.jsonl'\]"):
        read_rows(tmp_path / "data.csv")
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        read_rows(tmp_path / "missing.parquet")


def test_unreadable_files_are_one_line_with_file_and_line(tmp_path, char_tokenizer):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(_countdown_row()) + "\n{oops\n")
    with pytest.raises(DataFormatError) as error:
        read_rows(bad_json)
    assert str(error.value) == (f"{bad_json} line 2: not valid JSON (Expecting property name enclosed in double "
                                "quotes at column 2); each line must hold one JSON object")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps(_countdown_row()).encode() + b"\n" + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    offset = len(json.dumps(_countdown_row())) + 1 + len('{"prompt": "caf')
    with pytest.raises(DataFormatError) as error:
        read_rows(latin1)
    assert str(error.value) == (f"{latin1} line 2: not UTF-8 (byte 0xe9 at byte offset {offset} of the "
                                "file); save the file as UTF-8")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(DataFormatError, match=r"broken.parquet: not a readable parquet file \("):
        read_rows(broken)


def test_a_bom_does_not_hide_the_first_row(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_countdown_row()).encode() + b"\n")
    assert read_rows(path) == [_countdown_row()]


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.parquet", "")])
def test_an_empty_file_is_named(tmp_path, char_tokenizer, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataFormatError) as error:
        PromptDataset(DataConfig(files=[str(path)]), char_tokenizer)
    assert str(error.value) == (f"{path}: no rows (the file is empty); each file of data.files needs at least one "
                                "prompt row")


def test_missing_prompt_column_suggests_prompt_key(tmp_path, char_tokenizer):
    row = {"question": "1+1=", "data_source": "countdown", "reward_model": {"ground_truth": "2"}}
    path = write_rows([row], tmp_path / "q.jsonl")
    with pytest.raises(DataFormatError) as error:
        PromptDataset(DataConfig(files=[path]), char_tokenizer, config_key="val_data")
    assert str(error.value) == (f"{path} row 0: missing field(s) ['prompt']; the row has ['data_source', 'question', "
                                "'reward_model']; if the prompt is in another column, set val_data.prompt_key to it")
    assert PromptDataset(DataConfig(files=[path], prompt_key="question"), char_tokenizer)[0].ground_truth == "2"


def test_a_tokenizer_without_chat_template_names_the_setting(tmp_path):
    from rlmega.data import build_char_tokenizer
    from rlmega.errors import UserError

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    path = write_rows([_countdown_row()], tmp_path / "t.jsonl")
    with pytest.raises(UserError) as error:
        PromptDataset(DataConfig(files=[path]), tokenizer)
    assert str(error.value) == ("data.use_chat_template: the tokenizer has no chat template; set "
                                "data.use_chat_template=false to tokenize the prompts' text as it is")


def _long_prompt_file(tmp_path):
    rows = [_countdown_row(prompt="ab"), _countdown_row(prompt="0123456789"), _countdown_row(prompt="cd")]
    return write_rows(rows, tmp_path / "long.parquet")


def test_truncation_error_names_row_and_lengths(tmp_path, char_tokenizer):
    path = _long_prompt_file(tmp_path)
    # "<bos><|user|>" + 10 chars + "<eos><|assistant|>" = 14 tokens
    with pytest.raises(DataFormatError) as error:
        PromptDataset(DataConfig(files=[path], max_prompt_length=8), char_tokenizer)
    assert str(error.value) == (
        f"{path} row 1: the prompt is 14 tokens, longer than data.max_prompt_length=8; set data.truncation=left "
        "(keep its end) or data.filter_overlong_prompts=true (skip such prompts), or raise data.max_prompt_length")
    with pytest.raises(DataFormatError, match="longer than val_data.max_prompt_length=8; set val_data.truncation"):
        PromptDataset(DataConfig(files=[path], max_prompt_length=8), char_tokenizer, config_key="val_data")


@pytest.mark.parametrize("truncation, expected", [
    ("left", "456789<eos><|assistant|>"),
    ("right", "<bos><|user|>012345"),
])
def test_truncation_left_and_right(tmp_path, char_tokenizer, truncation, expected):
    dataset = PromptDataset(DataConfig(files=[_long_prompt_file(tmp_path)], max_prompt_length=8,
                                       truncation=truncation), char_tokenizer)
    assert len(dataset) == 3 and dataset.num_truncated == 1
    assert len(dataset[1].prompt_token_ids) == 8
    assert char_tokenizer.decode(dataset[1].prompt_token_ids) == expected


def test_filter_overlong_prompts_drops_them_and_reindexes(tmp_path, char_tokenizer):
    dataset = PromptDataset(DataConfig(files=[_long_prompt_file(tmp_path)], max_prompt_length=8,
                                       filter_overlong_prompts=True), char_tokenizer)
    assert dataset.num_filtered == 1 and len(dataset) == 2
    assert [(record.index, record.source_row) for record in dataset.records] == [(0, 0), (1, 2)]
    with pytest.raises(ValueError, match="no prompts left"):
        PromptDataset(DataConfig(files=[_long_prompt_file(tmp_path)], max_prompt_length=2,
                                 filter_overlong_prompts=True), char_tokenizer)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="DataConfig.truncation must be one of"):
        DataConfig(files=["a.parquet"], truncation="middle")
    with pytest.raises(ValueError, match="DataConfig.max_prompt_length"):
        DataConfig(files=["a.parquet"], max_prompt_length=0)
    with pytest.raises(ValueError, match="DataConfig.files"):
        PromptDataset(DataConfig(), tokenizer=None)


def test_missing_chat_template_is_explained(char_tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="use_chat_template=False"):
        prompt_text([{"role": "user", "content": "x"}], NoTemplate())


def test_chat_template_kwargs_reach_the_template(tmp_path):
    from rlmega.data import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% if think %}T{% endif %}{{ messages[0]['content'] }}"
    path = write_rows([_countdown_row(prompt="q")], tmp_path / "t.jsonl")
    plain = PromptDataset(DataConfig(files=[path]), tokenizer)[0]
    thinking = PromptDataset(DataConfig(files=[path], chat_template_kwargs={"think": True}), tokenizer)[0]
    assert tokenizer.decode(plain.prompt_token_ids) == "q"
    assert tokenizer.decode(thinking.prompt_token_ids) == "Tq"


def test_datasets_moved_with_their_files_name_the_new_place(tmp_path, char_tokenizer):
    """Tiny assets are checked where they were built, then moved into the run directory: the records follow."""
    from rlmega.data import PromptDatasets

    built, moved = tmp_path / "built", tmp_path / "run" / "assets"
    train = write_rows([_countdown_row(), _countdown_row()], built / "train.jsonl")
    elsewhere = write_rows([_countdown_row()], tmp_path / "val.jsonl")
    datasets = PromptDatasets.read(DataConfig(files=[train]), DataConfig(files=[elsewhere]), char_tokenizer)
    datasets.relocate(str(built), str(moved))
    assert [r.source_file for r in datasets.train.records] == [str(moved / "train.jsonl")] * 2
    assert datasets.val.records[0].source_file == elsewhere

"""Demonstrated trajectories (``agent.demonstration``, the warm-start's data) are built by the loop itself: the same
tokens and mask as a rollout whose engine wrote the demonstrated turns, tools really called; the warm-start batch
masks out tool output and glue; a demonstration that returns something else is one clear error naming the row."""

import pytest

from rlmega.agent.examples import calculator_demonstration
from rlmega.agent.loop import example_of
from rlmega.config import load_config
from rlmega.errors import UserError
from rlmega.rollout.protocol import SamplingParams
from rlmega.trainer.prompt_side import build_prompt_side

from .helpers import record
from .test_loop import CALL, EOS, TOKENIZER, encode, loop, turns


def test_a_demonstration_is_the_rollout_of_an_engine_that_writes_its_turns():
    records = [record("3+5="), record("1+1=", index=1, ground_truth="2")]
    rolled = loop().run(turns(CALL, "8"), records, SamplingParams(max_new_tokens=300, stop_token_ids=(EOS,), n=1))
    tools = loop().tools
    demonstrated = loop(tools=tools).demonstrate(records, [[CALL, "8"], [CALL, "8"]])
    assert len(tools.calls) == 2  # the calls in the turns ran
    for shown, run in zip(demonstrated, rolled):
        assert shown.prompt_token_ids == run.prompt_token_ids
        assert shown.response_token_ids == run.response_token_ids and shown.loss_mask == run.loss_mask
        assert (shown.num_turns, shown.num_tool_calls, shown.stop_reason) == (2, 1, "answered")


def test_a_demonstration_that_ends_early_is_kept_as_far_as_it_goes():
    (shown,) = loop().demonstrate([record("3+5=")], [[CALL]])
    text = TOKENIZER.decode(shown.response_token_ids, skip_special_tokens=False)
    assert text == CALL + "<eos><|tool|>8<eos><|assistant|>"
    assert shown.loss_mask == [1] * (len(encode(CALL)) + 1) + [0] * len(encode("<|tool|>8<eos><|assistant|>"))


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=16, num_val=4, max_operand=99)


def _prompts(tmp_path, assets, *overrides):
    (tmp_path / "assets").symlink_to(assets)
    config = load_config("tiny_cpu_tools", [f"run_dir={tmp_path}", "trainer.prompts_per_step=2", "rollout.n=2",
                                            "trainer.sft_steps=2", *overrides])
    return build_prompt_side(config)


def test_the_tools_warm_start_trains_the_two_turns_only(tmp_path, assets):
    prompts = _prompts(tmp_path, assets)
    try:
        batches = list(prompts.warm_start.batches())
        assert len(batches) == 2 and all(len(batch.tokens) == 4 for batch in batches)
        tokenizer = prompts.data.tokenizer
        for tokens, prompt, mask in zip(batches[0].tokens, batches[0].prompt_lengths,
                                        batches[0].fields["response_mask"]):
            text = tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
            expression = text.split("<|user|>")[1].split(tokenizer.eos_token)[0]
            a, b = (int(x) for x in expression[:-1].split("+"))
            eos = tokenizer.eos_token
            assert text.endswith(f"<|assistant|>{expression}{eos}<|tool|>{a + b}{eos}<|assistant|>{a + b}{eos}")
            kept = [token for token, m in zip(tokens[prompt:].tolist(), mask.tolist()) if m]
            assert tokenizer.decode(kept, skip_special_tokens=False) == f"{expression}{eos}{a + b}{eos}"
    finally:
        prompts.close()


def test_a_demonstration_returning_no_list_names_the_row(tmp_path, assets):
    demonstration = tmp_path / "demo.py"
    demonstration.write_text("def bad(example):\n    return 'a+b='\n")
    prompts = _prompts(tmp_path, assets, f"agent.demonstration={demonstration}:bad")
    try:
        with pytest.raises(UserError, match=r"agent.demonstration .*demo.py:bad: returned 'a\+b=' for row \d+; it "
                                            "must return a list of assistant turn texts"):
            next(prompts.warm_start.batches())
    finally:
        prompts.close()


def test_the_calculator_demonstration():
    example = example_of(record("37+48=", ground_truth="85"))
    assert calculator_demonstration(example) == ["37+48=", "85"]

"""Bad input fails well: one line that says what is wrong, where, and how to fix it; from the command
line, exit code 2 and nothing else on stderr, before anything starts."""

import json
import os
import subprocess
import sys

import pytest

from rlmega.config import ConfigError, load_config, validate
from rlmega.config.explain import schema_fields
from rlmega.data import write_rows
from rlmega.errors import UserError
from rlmega.trainer.assets import prepare_tiny_assets

ALGOS = "dapo, grpo, ppo, reinforce_plus_plus, rloo"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    prepare_tiny_assets(run_dir / "assets", num_train=64, num_val=16)
    return run_dir


@pytest.fixture
def no_gpus(monkeypatch):
    """This machine as one without CUDA devices and without a Ray cluster to join."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _error(run_dir, *overrides, config="tiny_cpu") -> str:
    with pytest.raises(UserError) as error:
        load_config(config, [f"run_dir={run_dir}", *overrides])
    message = str(error.value)
    assert "\n" not in message
    return message


def _row(**fields):
    row = {"data_source": "rlmega/arithmetic", "prompt": "1+2=", "reward_model": {"ground_truth": "3"}}
    row.update(fields)
    return row


# ---- overrides and YAML files (Hydra, OmegaConf) -----------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("trainer.totl_epochs=3", "trainer.totl_epochs: no such field; did you mean trainer.total_epochs?"),
    ("+trainer.totl_epochs=3", "trainer.totl_epochs: no such field; did you mean trainer.total_epochs?"),
    ("trainr.total_steps=3", "trainr: no such field; did you mean trainer?"),
    ("algoo=dapo", "algoo: no such field; did you mean algo?"),
    ("trainer.max_new_tokens=3", "trainer.max_new_tokens: no such field; did you mean rollout.max_new_tokens?"),
    ("model.zzz=1", "model.zzz: no such field; model has: path, tokenizer_path, mtp"),
    ("trainer.prompts_per_step=abc", "trainer.prompts_per_step: expected an int, got 'abc'"),
    ("rollout.max_new_tokens=1.5", "rollout.max_new_tokens: expected an int, got 1.5"),
    ("rollout.top_k=abc", "rollout.top_k: expected an int or null, got 'abc'"),
    ("trainer.total_steps=null", "trainer.total_steps: expected an int, got null"),
    ("rollout.gpus_per_engine=x", "rollout.gpus_per_engine: expected a number, got 'x'"),
    ("export_hf=maybe", "export_hf: expected true or false, got 'maybe'"),
    ("data.files=abc", "data.files: expected a list such as [a,b], got 'abc'"),
    ("trainer=3", "trainer: expected a mapping of TrainerConfig fields, got 3"),
    ("rollout.engine_kwargs.foo=1", "rollout.engine_kwargs.foo: not a field of the schema; free-form keys of "
                                    "rollout.engine_kwargs need a leading +, as in +rollout.engine_kwargs.foo=1"),
    ("algo=grpoo", f"algo=grpoo: no such option; choose one of {ALGOS}"),
    ("trainer.total_steps", "trainer.total_steps: not an override (missing EQUAL at '<EOF>'); write key=value, "
                            "and quote a value with spaces or '=' (key='a=b')"),
    ("model.path=${run_dirr}", "model.path: Interpolation key 'run_dirr' not found"),
])
def test_override_errors_say_what_is_wrong(run_dir, override, message):
    assert _error(run_dir, override) == message


def test_the_field_list_covers_the_schema_tree():
    fields = schema_fields()
    assert fields["trainer.total_epochs"] is not None and "rollout.engine_kwargs" in fields
    assert "actor.policy_loss.kl_estimator" in fields and "algorithm.rollout_correction.rollout_is" in fields
    assert not any(name.startswith("rollout.engine_kwargs.") for name in fields)


def _yaml(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


SCHEMA_FIRST = "defaults:\n  - rlmega_schema\n  - _self_\n"


def test_errors_in_a_yaml_file_name_the_file(tmp_path, run_dir):
    broken = _yaml(tmp_path, "broken.yaml", SCHEMA_FIRST + "trainer:\n  total_steps: 3\n   val_every: [1\n")
    assert _error(run_dir, config=str(broken)) == (
        f"{broken} line 6: not valid YAML: mapping values are not allowed here (column 13)")
    tab = _yaml(tmp_path, "tab.yaml", SCHEMA_FIRST + "trainer:\n\ttotal_steps: 3\n")
    assert _error(run_dir, config=str(tab)) == (
        f"{tab} line 5: not valid YAML: found character '\\t' that cannot start any token (column 1)")
    typo = _yaml(tmp_path, "typo.yaml", SCHEMA_FIRST + "trainer:\n  totl_epochs: 3\n")
    assert _error(run_dir, config=str(typo)) == (
        f"{typo}: trainer.totl_epochs: no such field; did you mean trainer.total_epochs?")
    wrong_type = _yaml(tmp_path, "wrong_type.yaml", SCHEMA_FIRST + "trainer:\n  prompts_per_step: abc\n")
    assert _error(run_dir, config=str(wrong_type)) == (
        f"{wrong_type}: trainer.prompts_per_step: expected an int, got 'abc'")
    group = _yaml(tmp_path, "group.yaml", "defaults:\n  - rlmega_schema\n  - algo: grpoo\n  - _self_\n")
    assert _error(run_dir, config=str(group)) == f"{group}: algo=grpoo: no such option; choose one of {ALGOS}"
    unset = _yaml(tmp_path, "unset.yaml", SCHEMA_FIRST)
    assert _error(run_dir, config=str(unset)) == (
        "model.path: required, and nothing sets it; give it, as in model.path=...")


def test_a_yaml_outside_configs_picks_the_shipped_groups(tmp_path, run_dir):
    mine = _yaml(tmp_path, "mine.yaml", "defaults:\n  - rlmega_schema\n  - algo: dapo\n  - _self_\n"
                 "model:\n  path: ${run_dir}/assets/model\n")
    config = load_config(str(mine), [f"run_dir={run_dir}"], check=False)
    assert config.algorithm.dynamic_sampling and config.actor.policy_loss.clip_ratio_high == 0.28


# ---- checks that validate makes before anything starts -----------------------------------------


@pytest.mark.parametrize("override, message", [
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens: must be an int >= 1, got 0"),
    ("rollout.max_new_tokens=-4", "rollout.max_new_tokens: must be an int >= 1, got -4"),
    ("trainer.prompts_per_step=0", "trainer.prompts_per_step: must be an int >= 1, got 0"),
    ("rollout.n=0", "rollout.n: must be an int >= 1, got 0"),
    ("trainer.val_prompts=0", "trainer.val_prompts: must be an int >= 1, got 0"),
    ("trainer.sft_steps=-1", "trainer.sft_steps: must be an int >= 0, got -1"),
    ("trainer.val_every=-5", "trainer.val_every: must be an int >= 0, got -5"),
    ("rollout.val_n=0", "rollout.val_n: must be an int >= 1, got 0"),
    ("rollout.val_top_p=0", "rollout.val_top_p: must be in (0, 1], or null for rollout.top_p"),
    ("rollout.val_top_k=-1", "rollout.val_top_k: must be >= 0 (0: no top-k), or null for rollout.top_k"),
    ("rollout.val_temperature=-0.5", "rollout.val_temperature: must be >= 0 (0: greedy)"),
    ("algorithm.dynamic_sampling_metric=' '", "algorithm.dynamic_sampling_metric: must name a value: shaped_score, "
                                              "score, or a number the reward function returns (e.g. acc)"),
    ("trainer.prompts_per_step=100", "trainer.prompts_per_step: 100 prompts per step, but data.files hold 64; "
                                     "lower trainer.prompts_per_step or add prompts"),
])
def test_sizes_are_checked_by_name(run_dir, override, message):
    assert _error(run_dir, override) == message


def test_a_size_set_in_python_must_be_an_int(run_dir):
    config = load_config("tiny_cpu", [f"run_dir={run_dir}"], check=False)
    config.rollout.n = 2.5
    with pytest.raises(ConfigError, match=r"^rollout.n: must be an int >= 1, got 2.5$"):
        validate(config)


@pytest.mark.parametrize("override", ["rollout.gpus_per_engine=1", "cluster.gpus_per_rank=0.5"])
def test_gpus_on_a_machine_without_any_are_refused(run_dir, no_gpus, override):
    field, value = override.split("=")
    assert _error(run_dir, override) == (
        f"{field}={value} asks for GPUs, but this machine has none (torch.cuda.device_count() == 0); "
        "set it to 0 or join a Ray cluster with GPUs via cluster.ray_address")
    load_config("tiny_cpu", [f"run_dir={run_dir}", override, "cluster.ray_address=auto"])  # the cluster's GPUs


def test_ray_address_in_the_environment_also_joins_a_cluster(run_dir, no_gpus, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    load_config("tiny_cpu", [f"run_dir={run_dir}", "rollout.gpus_per_engine=1"])


# ---- data files, read at validate ---------------------------------------------------------------


def test_data_errors_name_file_row_and_fix(tmp_path, run_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _error(run_dir, f"data.files=[{empty}]") == (
        f"{empty}: no rows (the file is empty); each file of data.files needs at least one prompt row")
    no_prompt = write_rows([{"question": "1+2=", "data_source": "rlmega/arithmetic",
                             "reward_model": {"ground_truth": "3"}}], tmp_path / "no_prompt.jsonl")
    assert _error(run_dir, f"data.files=[{no_prompt}]") == (
        f"{no_prompt} row 0: missing field(s) ['prompt']; the row has ['data_source', 'question', 'reward_model']; "
        "if the prompt is in another column, set data.prompt_key to it")
    no_answer = write_rows([_row(), _row(reward_model={"style": "rule"})], tmp_path / "no_answer.jsonl")
    assert _error(run_dir, f"val_data.files=[{no_answer}]") == (
        f"{no_answer} row 1: missing field 'reward_model.ground_truth' (the answer the reward scorer compares with); "
        "every row needs one")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(_row()) + "\n{oops\n")
    assert _error(run_dir, f"data.files=[{bad_json}]") == (
        f"{bad_json} line 2: not valid JSON (Expecting property name enclosed in double quotes at column 2); "
        "each line must hold one JSON object")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "\u00e9"}\n'.encode("latin-1"))
    assert _error(run_dir, f"data.files=[{latin1}]") == (
        f"{latin1} line 1: not UTF-8 (byte 0xe9 at byte offset 12 of the file); save the file as UTF-8")
    unscored = write_rows([_row(), _row(data_source="my_task")], tmp_path / "unscored.jsonl")
    assert _error(run_dir, f"data.files=[{unscored}]", "trainer.prompts_per_step=2") == (
        f"{unscored} row 1: no rule scorer for data_source 'my_task'; valid: "
        "DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500, countdown, exact_match, gsm8k, lighteval/MATH, "
        "math, openai/gsm8k, rlmega/arithmetic; or score every row with reward.user_function=path/to/file.py:function")


def test_an_overlong_prompt_names_the_row_and_the_settings(run_dir):
    train = run_dir / "assets" / "train.parquet"
    assert _error(run_dir, "data.max_prompt_length=4") == (
        f"{train} row 0: the prompt is 8 tokens, longer than data.max_prompt_length=4; set data.truncation=left "
        "(keep its end) or data.filter_overlong_prompts=true (skip such prompts), or raise data.max_prompt_length")
    assert _error(run_dir, "data.max_prompt_length=4", "data.filter_overlong_prompts=true") == (
        "data.files: no prompts left: all 64 are longer than data.max_prompt_length=4 and "
        "data.filter_overlong_prompts=true drops them; raise data.max_prompt_length")
    load_config("tiny_cpu", [f"run_dir={run_dir}", "data.max_prompt_length=4", "data.truncation=left"])


def test_a_reward_function_missing_from_its_file_is_named(tmp_path, run_dir):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("import math\n\ndef compute_score(**kwargs):\n    return 1.0\n\n\ndef _helper():\n    pass\n")
    spec = f"{rewards}:score"
    assert _error(run_dir, f"reward.user_function={spec}") == (
        f"reward.user_function={spec}: {rewards} has no function score (it defines: compute_score, _helper)")
    load_config("tiny_cpu", [f"run_dir={run_dir}", f"reward.user_function={rewards}:compute_score"])
    rewards.write_text("from math import isclose as score\n")  # an imported name counts
    load_config("tiny_cpu", [f"run_dir={run_dir}", f"reward.user_function={spec}"])
    rewards.write_text("def score(:\n")
    assert _error(run_dir, f"reward.user_function={spec}") == (
        f"reward.user_function={spec}: {rewards} line 1: not valid Python (invalid syntax)")


# ---- the command line: exit code 2, one line on stderr, nothing started -------------------------

# Runs `rlmega` with the run itself replaced by a stub that fails loudly, so a check that stopped
# working cannot start training; and as a machine without CUDA devices.
CLI = """
import sys, types
import torch
torch.cuda.device_count = lambda: 0
build = types.ModuleType("rlmega.trainer.build")
def started(config, datasets=None):
    raise SystemExit("the run started")
build.run = build.run_sft = started
sys.modules["rlmega.trainer.build"] = build
from rlmega.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(run_dir, *arguments):
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    before = sorted(run_dir.rglob("*"))
    result = subprocess.run([sys.executable, "-c", CLI, *arguments, f"run_dir={run_dir}"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert sorted(run_dir.rglob("*")) == before  # nothing left behind
    return result


@pytest.mark.parametrize("arguments, message", [
    (["train", "--print-config", "trainer.totl_epochs=3"],
     "trainer.totl_epochs: no such field; did you mean trainer.total_epochs?"),
    (["train", "--print-config", "algo=grpoo"], f"algo=grpoo: no such option; choose one of {ALGOS}"),
    (["train", "rollout.max_new_tokens=0"], "rollout.max_new_tokens: must be an int >= 1, got 0"),
    (["sft", "rollout.gpus_per_engine=1"],
     "rollout.gpus_per_engine=1 asks for GPUs, but this machine has none (torch.cuda.device_count() == 0); "
     "set it to 0 or join a Ray cluster with GPUs via cluster.ray_address"),
])
def test_the_command_line_prints_one_line_and_exits_2(run_dir, arguments, message):
    result = _cli(run_dir, *arguments)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"rlmega {arguments[0]}: {message}\n")


def test_the_command_line_names_a_bad_yaml_file_and_a_bad_data_row(tmp_path, run_dir):
    broken = _yaml(tmp_path, "broken.yaml", SCHEMA_FIRST + "trainer: [1\n")
    result = _cli(run_dir, "train", "--config", str(broken), "--print-config")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"rlmega train: {broken} line 5: not valid YAML: expected ',' or ']', but got "
                             "'<stream end>' (column 1)\n")
    train = run_dir / "assets" / "train.parquet"
    result = _cli(run_dir, "train", "data.max_prompt_length=4")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"rlmega train: {train} row 0: the prompt is 8 tokens, longer than data.max_prompt_length=4; set "
        "data.truncation=left (keep its end) or data.filter_overlong_prompts=true (skip such prompts), or raise "
        "data.max_prompt_length\n")


def _fresh_cli(tmp_path, *arguments):
    """The stubbed command on a run directory that does not exist yet, with a temporary directory of its own."""
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    env = {**{key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}, "TMPDIR": str(scratch)}
    result = subprocess.run([sys.executable, "-c", CLI, "train", f"run_dir={tmp_path / 'run'}", *arguments],
                            capture_output=True, text=True, timeout=120, env=env)
    assert list(scratch.glob("rlmega-*")) == []  # the assets built aside are gone
    return result


@pytest.mark.parametrize("arguments, message", [
    (["layout.tp=3", "layout.world_size=3"], "layout: num_attention_heads=4 is not divisible by tp=3"),  # the model's
    (["trainer.prompts_per_step=5000"], "trainer.prompts_per_step: 5000 prompts per step, but data.files hold 2000"),
])
def test_checks_that_need_the_tiny_assets_write_nothing_into_the_run_directory(tmp_path, arguments, message):
    result = _fresh_cli(tmp_path, *arguments)
    assert (result.returncode, result.stdout) == (2, "") and result.stderr.startswith(f"rlmega train: {message}")
    assert not (tmp_path / "run").exists()


def test_a_valid_config_gets_its_tiny_assets_moved_into_the_run_directory(tmp_path):
    result = _fresh_cli(tmp_path, "trainer.val_every=0")
    assert "the run started" in result.stderr, result.stderr[-3000:]
    assets = tmp_path / "run" / "assets"
    assert sorted(p.name for p in assets.iterdir()) == ["model", "train.parquet", "val.parquet"]
    assert (assets / "model" / "config.json").is_file()


@pytest.mark.parametrize("overrides,message", [
    (["actor.router_replay=r2"], "actor.router_replay: r2 replays MoE routing;"),
    (["actor.router_replay=r3"], "actor.router_replay: r3 replays MoE routing;"),
    (["ref.router_replay=r2"], "ref.router_replay: only the actor replays routing"),
    (["actor.router_replay=R2"], "router_replay='R2' must be none, r2 or r3"),
])
def test_router_replay_is_checked_up_front(run_dir, overrides, message):
    with pytest.raises(UserError) as error:
        validate(load_config("tiny_cpu", [f"run_dir={run_dir}", *overrides]))
    assert "\n" not in str(error.value) and message in str(error.value), str(error.value)

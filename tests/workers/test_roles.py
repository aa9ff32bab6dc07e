"""Each role of the Megatron worker: what it serves, and that a real worker of that role refuses every
other batch method with a message naming its role."""

import pytest
import torch

from hf_models import save_tiny_model
from reward_models import save_tiny_reward_model
from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.config import WorkerConfig
from rlmega.workers.roles import REFUSALS, ROLES, Output
from rlmega.workers.worker import MegatronWorker

TIMEOUT_S = 240
BATCH_METHODS = ("compute_logprobs", "compute_values", "compute_scores", "compute_top_k", "update", "update_on_policy",
                 "sft_step")


def test_each_role_says_what_it_has():
    assert {name: (role.output, role.trains, sorted(role.methods)) for name, role in ROLES.items()} == {
        "actor": (Output.LOGITS, True, ["compute_logprobs", "sft_step", "update", "update_on_policy"]),
        "ref": (Output.LOGITS, False, ["compute_logprobs"]),
        "critic": (Output.VALUES, True, ["compute_values", "update"]),
        "reward": (Output.SCORES, False, ["compute_scores"]),
        "teacher": (Output.LOGITS, False, ["compute_logprobs", "compute_top_k"]),
    }
    assert [name for name, role in ROLES.items() if not role.loads_lm_head] == ["critic"]
    assert [name for name, role in ROLES.items() if role.replays_routing] == ["actor", "ref", "teacher"]
    assert [name for name, role in ROLES.items() if role.records_routing] == ["actor"]
    assert {name: role.loss_metric for name, role in ROLES.items() if role.trains} == {"actor": "loss",
                                                                                       "critic": "vf_loss"}
    assert [WorkerConfig(role=name).trains for name in ROLES] == [role.trains for role in ROLES.values()]
    with pytest.raises(ValueError, match="worker role 'judge' must be one of actor, ref, critic, reward, teacher"):
        WorkerConfig(role="judge")


def test_a_role_refuses_what_it_does_not_serve_by_name():
    with pytest.raises(RuntimeError, match="^compute_values needs a critic worker; this one is the actor$"):
        ROLES["actor"].require("compute_values")
    with pytest.raises(RuntimeError, match="^the reward worker does not train; use role actor or critic$"):
        ROLES["reward"].require("update")
    ROLES["critic"].require("update")


def _refusals_body(rank, world_size, llama_dir, reward_dir):
    initialize(ParallelLayout(world_size=1))
    batch = SequenceBatch([torch.tensor([3, 5, 7, 9])], [2])
    calls = {"compute_logprobs": lambda w: w.compute_logprobs(batch),
             "compute_values": lambda w: w.compute_values(batch), "compute_scores": lambda w: w.compute_scores(batch),
             "compute_top_k": lambda w: w.compute_top_k(batch, 2),
             "update": lambda w: w.update(batch), "update_on_policy": lambda w: w.update_on_policy(batch),
             "sft_step": lambda w: w.sft_step(batch, 1e-3)}
    refusals = {}
    for name in ROLES:
        spec = model_spec_from_hf(reward_dir if name == "reward" else llama_dir)
        worker = MegatronWorker(spec, ParallelLayout(world_size=1), WorkerConfig(role=name))
        assert (worker.optimizer is not None) == ROLES[name].trains
        for method in BATCH_METHODS:
            if ROLES[name].serves(method):
                continue
            try:
                calls[method](worker)
            except RuntimeError as error:
                refusals[name, method] = str(error)
    destroy()
    return refusals


def test_workers_refuse_the_methods_their_role_does_not_serve(tmp_path):
    save_tiny_model("llama", tmp_path / "llama")
    save_tiny_reward_model("llama", tmp_path / "reward")
    [refusals] = run_on_ranks(_refusals_body, 1, timeout_s=TIMEOUT_S,
                              args=(str(tmp_path / "llama"), str(tmp_path / "reward")))
    on_policy = ("update_on_policy needs the actor with ppo_epochs=1 and ppo_mini_batches=1: with more optimizer "
                 "steps per batch the old log-probs need their own pass")
    expected = {(name, method): on_policy if method == "update_on_policy" else REFUSALS[method].format(role=name)
                for name, role in ROLES.items() for method in BATCH_METHODS if not role.serves(method)}
    assert refusals == expected
    assert refusals["ref", "compute_values"] == "compute_values needs a critic worker; this one is the ref"

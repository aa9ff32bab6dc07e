"""The ``sliced`` transport (rlmega.sync.sliced) carries out the transfer plan on CPU (``rlmega.sync.sliced_emulation``):
8 gloo training ranks of a MoE model (TP2 x PP2 x EP2, two data-parallel replicas that share the sending) feed 4
engine-rank processes (two engines of TP2 holding every expert split in two, colocated on GPUs 0-3 of nodes of two
GPUs, so that the plan uses all three link kinds).

Every engine rank ends with exactly its region of every tensor it holds, bit for bit the checkpoint's, and after a
second update over the kept group the new weights'; the bytes each training rank sent and each engine rank received,
per link kind, are the plan's to the byte; the plan the ranks follow is the one the planner makes from the config
alone. A training rank that fails mid-transfer fails the update on every side, naming it, with nothing committed.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bridge.hf_models import save_tiny_model
from rlmega.bridge.layout_pieces import placed_pieces
from rlmega.parallel.layout import ParallelLayout
from rlmega.rollout.engine_bytes import EngineLayout
from rlmega.sync.sliced_emulation import Emulation, emulate
from rlmega.sync.transfer_plan import LINKS

TRAINING = ParallelLayout(tp=2, pp=2, ep=2, world_size=8)
ENGINE = EngineLayout(tensor_parallel_size=2, expert_parallel_size=1, dtype_bytes=4)
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sliced-moe")
    save_tiny_model("qwen3-moe", directory)
    return directory


def _emulation(moe_dir, **overrides) -> Emulation:
    return Emulation(str(moe_dir), TRAINING, ENGINE, num_engines=2, gpus_per_node=2, colocated=True,
                     timeout_s=TIMEOUT_S, **overrides)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_training_ranks_feed_engine_ranks_exactly_as_planned(moe_dir):
    emulation = _emulation(moe_dir)
    report = emulate(emulation)
    assert report.placed == placed_pieces(emulation.hf_config, TRAINING, dtype=torch.float32,
                                          transformer_engine=False)  # the ranks follow what the planner plans
    traffic = report.plan.traffic
    assert all(traffic.link_bytes[link] > 0 for link in LINKS), traffic.link_bytes
    assert len(report.plan.buckets(emulation.bucket_bytes)) >= 4  # two buckets in flight at a time
    assert report.errors == [[]] * TRAINING.world_size
    checkpoint = load_file(Path(moe_dir) / "model.safetensors")
    for update in range(emulation.updates):
        assert report.mismatches(update, checkpoint) == []
        sent, received = report.measured(update)
        assert np.array_equal(sent, traffic.sent_bytes) and np.array_equal(received, traffic.received_bytes)
    # The replicas share the sending: every training rank sends.
    assert (traffic.sent_bytes[:TRAINING.world_size].sum(axis=1) > 0).all()


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_training_rank_failing_mid_transfer_fails_the_update_on_every_side(moe_dir):
    report = emulate(_emulation(moe_dir, updates=4, fail_rank=5, fail_update=2))
    assert [update for update, _ in report.errors[5]] == [2]
    assert "conversion failed on purpose" in report.errors[5][0][1]
    assert [update for update, _ in report.errors[0]] == [2]  # the rank that reports to the trainer
    assert all(update == 2 for errors in report.errors for update, _ in errors), report.errors
    failed = report.engines[2]
    assert all(result.regions is None and "training rank 5" in result.error for result in failed), [
        (result.regions is None, result.error) for result in failed]
    # The updates before it went through, and the one after it, on a new store and group.
    checkpoint = load_file(Path(moe_dir) / "model.safetensors")
    assert [report.mismatches(update, checkpoint) for update in (0, 1, 3)] == [[], [], []]

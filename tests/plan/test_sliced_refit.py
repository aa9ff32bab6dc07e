"""The planner's sliced refit (rlmega.plan.sliced_refit): the time model on hand-made traffic, ``sync.transport=
sharded_rdt`` predicted from its transfer plan, the target on every recipe, and ``--explain``'s per-link table."""

from pathlib import Path

import numpy as np
import pytest

from rlmega.cli.main import main
from rlmega.config import load_config
from rlmega.plan import make_plan
from rlmega.plan.sliced_refit import gpu_times
from rlmega.sync.transfer_plan import Traffic

ROOT = Path(__file__).resolve().parents[2]
DEEPSEEK = "configs/recipes/deepseek_v3_671b/grpo.yaml"
QWEN3_235B = "configs/recipes/qwen3_235b_a22b/grpo.yaml"


@pytest.fixture(autouse=True)
def _repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name their config.json relative to the checkout


def test_a_gpu_takes_its_slowest_direction_and_link_plus_its_messages():
    # GPU 0 sends 100 GB over the network (2 s at 50 GB/s) and 900 GB over NVLink (2 s at 450): 2 s, not 4;
    # GPU 1 receives 10 GB over NVLink and 60 GB on its own GPU (a copy: free), 3000 messages of 20 us.
    sent = np.array([[0, 900e9, 100e9], [0, 0, 0]], dtype=np.int64)
    received = np.array([[0, 0, 0], [60e9, 10e9, 0]], dtype=np.int64)
    traffic = Traffic({}, {}, sent, received, np.array([10, 0]), np.array([0, 3000]))
    times = gpu_times(traffic, {"self": 0.0, "nvlink": 450.0, "network": 50.0}, 20e-6)
    assert [t.gpu for t in times] == [0, 1]
    assert times[0].seconds == pytest.approx(2.0 + 10 * 20e-6) and times[0].bound in ("network out", "nvlink out")
    assert times[1].seconds == pytest.approx(10 / 450 + 3000 * 20e-6) and times[1].bound == "nvlink in"
    assert times[1].messages == 3000 and times[1].received["self"] == 60e9


@pytest.mark.parametrize("recipe, limit", [(DEEPSEEK, 2.5), (QWEN3_235B, 1.5)])
def test_the_recipes_sliced_target_refits_in_seconds(recipe, limit):
    """DeepSeek-V3 on 256 H100 and Qwen3-235B-A22B on 64 H200: every rank sends what it owns to the engine ranks that
    hold it, against 26.8 s and 9.4 s through rank 0."""
    plan = make_plan(load_config(recipe, check=False), recipe)
    target = plan.refit.target
    assert target is not None and plan.refit.sliced is None and plan.refit.legs
    assert target.seconds <= limit < plan.refit.seconds_overlapped
    assert target.slowest.bound in ("network out", "network in") and target.link_bytes["network"] > 0
    assert target.plan_seconds < 20


def test_sharded_rdt_is_predicted_from_its_transfer_plan(capsys):
    """Replica 0 sends (as vLLM's sharded_rdt pulls); the table says so, and --explain prints the per-link table."""
    assert main(["plan", QWEN3_235B, "sync.transport=sharded_rdt", "--explain"]) == 0
    out = capsys.readouterr().out
    plan = make_plan(load_config(QWEN3_235B, overrides=["sync.transport=sharded_rdt"], check=False), QWEN3_235B)
    refit = plan.refit
    assert refit.transport == "sharded_rdt" and not refit.legs and not refit.sliced.replicas
    assert refit.seconds_overlapped == refit.sliced.seconds == refit.seconds_serial
    # Replica 0 alone sends more per GPU than every replica does.
    assert refit.sliced.seconds > refit.target.seconds
    assert "transport sharded_rdt: each engine GPU pulls only the blocks it holds" in out
    assert f"predicted {refit.sliced.seconds:.2f} s: GPU {refit.sliced.slowest.gpu}" in out
    explained = out.split("refit, the sliced transfer plan (sharded_rdt")[1]
    rows = {line.split()[0]: line.split() for line in explained.splitlines()[2:5]}
    assert set(rows) == {"on", "NVLink", "network"}
    assert rows["network"][1:] == [f"{refit.sliced.link_messages['network']:,}",
                                   f"{refit.sliced.link_bytes['network'] / 1e9:.1f}", "50",
                                   f"{refit.sliced.link_seconds['network']:.2f}"]
    assert f"GPU {refit.sliced.slowest.gpu}" in explained.split("busiest GPUs")[1]


def test_the_message_latency_is_a_stated_configurable_assumption():
    config = load_config(QWEN3_235B, overrides=["plan.message_latency_us=200"], check=False)
    slow = make_plan(config, QWEN3_235B).refit.target
    fast = make_plan(load_config(QWEN3_235B, check=False), QWEN3_235B).refit.target
    gpu = slow.slowest
    assert slow.message_latency_s == pytest.approx(200e-6) and fast.message_latency_s == pytest.approx(20e-6)
    assert slow.seconds > fast.seconds
    directions = max(gpu.sent["network"], gpu.received["network"]) / 50e9
    assert slow.seconds == pytest.approx(max(directions, max(gpu.sent["nvlink"], gpu.received["nvlink"]) / 450e9)
                                         + gpu.messages * 200e-6)

"""The plan counts vLLM's collective_rpc copy through host memory (shm_broadcast) to every worker of a TP > 1 engine,
at the measured memcpy bandwidth, and names the transport that avoids it."""

import re

from rlmega.cli.main import main
from rlmega.plan.config import PlanConfig


def test_buckets_through_collective_rpc_at_tp_2_cost_a_host_copy_per_worker(capsys):
    main(["plan", "configs/recipes/qwen3_8b/grpo.yaml"])  # vLLM TP2, shared_memory (auto)
    out = capsys.readouterr().out
    streamed = float(re.search(r"refit +([\d.]+) GB per sync", out).group(1))
    leg = re.search(r"engine driver -> its 2 workers through host memory \(vLLM collective_rpc; broadcast avoids it\): "
                    r"([\d.]+) GB over host memcpy, measured at ([\d.]+) GB/s = ([\d.]+) s", out)
    assert leg, out
    assert abs(float(leg.group(1)) - 2 * streamed) < 0.2 and float(leg.group(2)) == PlanConfig().host_copy_gb_per_s
    assert float(leg.group(3)) > 1.0  # seconds, not the NVLink's hundredths
    main(["plan", "configs/recipes/qwen3_8b/grpo.yaml", "sync.transport=broadcast"])
    assert "through host memory" not in capsys.readouterr().out

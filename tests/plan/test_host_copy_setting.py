"""The host-copy leg of the refit (vLLM's collective_rpc at TP > 1) runs at plan.host_copy_gb_per_s, a planner
setting beside the other link bandwidths: 12.8 GB/s unless set (an assumption to measure on the GPU node)."""

import re

from rlmega.cli.main import main
from rlmega.plan.config import PlanConfig

RECIPE = "configs/recipes/qwen3_8b/grpo.yaml"  # vLLM TP2, buckets through collective_rpc
LEG = re.compile(r"through host memory \(vLLM collective_rpc; broadcast avoids it\): ([\d.]+) GB over host memcpy, "
                 r"measured at ([\d.]+) GB/s = ([\d.]+) s")


def _leg(capsys, *overrides) -> tuple[float, float, float]:
    main(["plan", RECIPE, *overrides])
    found = LEG.search(capsys.readouterr().out)
    assert found
    return tuple(float(value) for value in found.groups())


def test_the_host_copy_bandwidth_is_a_plan_setting(capsys):
    assert PlanConfig().host_copy_gb_per_s == 12.8
    gigabytes, default_speed, default_time = _leg(capsys)
    assert default_speed == 12.8 and abs(default_time - gigabytes / 12.8) < 0.06
    same_bytes, speed, time = _leg(capsys, "plan.host_copy_gb_per_s=51.2")
    assert (same_bytes, speed) == (gigabytes, 51.2) and abs(time - gigabytes / 51.2) < 0.06


def test_plan_help_names_the_setting_and_where_to_measure_it(capsys):
    try:
        main(["plan", "--help"])
    except SystemExit:
        pass
    out = " ".join(capsys.readouterr().out.split())
    assert "plan.host_copy_gb_per_s" in out and "--tier cluster --only host-memcpy" in out


def test_a_host_copy_speed_that_is_not_one_is_refused_in_one_line(capsys):
    assert main(["plan", RECIPE, "plan.host_copy_gb_per_s=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rlmega plan: plan.host_copy_gb_per_s=0.0 is not a speed: give the host memory copy speed of the "
                   "GPU node in GB/s (12.8 unless set; bash tests/gpu/run_gpu_checks.sh --tier cluster --only "
                   "host-memcpy measures it)"], err

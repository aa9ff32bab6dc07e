"""A harness that crashes on the first trajectory of every prompt (tests/gateway/test_gateway_run.py)."""

from rlmega.gateway.examples import single_turn


def run(base_url, example):
    if example["sample"] == 0:
        raise RuntimeError("the harness crashed on purpose")
    return single_turn(base_url, example)

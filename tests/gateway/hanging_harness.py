"""A harness whose first trajectory of every prompt hangs until released (tests/gateway/test_gateway_async.py)."""

import threading

from rlmega.gateway.examples import single_turn

RELEASE = threading.Event()


def run(base_url, example):
    if example["sample"] == 0:
        RELEASE.wait(timeout=600)
        raise RuntimeError("released after its session was given up")
    return single_turn(base_url, example)

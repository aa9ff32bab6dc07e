"""User reward functions for the tests, loaded as 'tests/rewards/user_rewards.py:<name>' by worker processes."""

import os
import subprocess
import time


def compute_score(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str.strip() == ground_truth)


def with_metrics(data_source, solution_str, ground_truth, extra_info):
    return {"score": float(solution_str == ground_truth), "length": len(solution_str), "note": "not a number"}


def raises(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise RuntimeError("user function failed on purpose")
    return 1.0


def sleeps_forever(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "sleep":
        time.sleep(10_000)
    return 1.0


def starts_a_child_then_sleeps(data_source, solution_str, ground_truth, extra_info):
    child = subprocess.Popen(["sleep", "10000"])
    with open(extra_info["pid_file"], "w") as handle:
        handle.write(str(child.pid))
    time.sleep(10_000)


def exits_the_process(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "exit":
        os._exit(3)
    return 1.0


def returns_garbage(data_source, solution_str, ground_truth, extra_info):
    return {"accuracy": 1.0} if solution_str == "dict" else "high"


def worker_pid(data_source, solution_str, ground_truth, extra_info):
    return float(os.getpid())


not_callable = 3

"""The multi-rank harness: results per rank, and failures that name the rank and never leave orphans."""

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from rlmega.parallel.spawn import RankFailure, run_on_ranks


def _all_reduce_rank(rank, world_size):
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return rank, world_size, value.item()


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("bad shard on purpose")
    dist.barrier()  # rank 0 waits for a peer that is gone
    return rank


def _die_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


def _sleep_with_child(rank, world_size, pid_file):
    # A grandchild that would outlive a careless harness.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(f"{pid_file}.{rank}", "w") as handle:
        handle.write(str(child.pid))
    time.sleep(600)


def _environment_and_output(rank, world_size, name):
    os.write(1, f"rank {rank} says hello\n".encode())  # one write: the two ranks' lines do not interleave
    return os.environ.get(name), os.getcwd()


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_see_the_callers_environment_directory_and_output(start_method, monkeypatch, tmp_path, capfd):
    with capfd.disabled():  # the fork server runs before the variable is set, with stdio other than capfd's
        run_on_ranks(_all_reduce_rank, 1, timeout_s=60)
    monkeypatch.setenv("RLMEGA_TEST_MARK", start_method)
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    results = run_on_ranks(_environment_and_output, 2, timeout_s=60, args=("RLMEGA_TEST_MARK",),
                           start_method=start_method)
    assert results == [(start_method, str(tmp_path))] * 2
    out = capfd.readouterr().out  # written by the ranks to this test's stdout, not the fork server's
    assert sorted(line for line in out.splitlines() if "says hello" in line) == ["rank 0 says hello",
                                                                                "rank 1 says hello"]


def _how_started(rank, world_size):
    import sys

    import torch.distributed as dist

    return "rlmega.parallel.rank_preload" in sys.modules, str(dist.get_backend())


def test_ranks_are_spawned_where_the_caller_sees_a_gpu(monkeypatch):
    """A process forked after torch was asked about CUDA (the preloaded imports ask) cannot use CUDA, so with
    a GPU in sight the ranks start from scratch; without one they come from the fork server, preloaded."""
    import torch

    assert run_on_ranks(_how_started, 1, timeout_s=60) == [(True, "gloo")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # this process only: the ranks see no GPU
    assert run_on_ranks(_how_started, 1, timeout_s=120) == [(False, "gloo")]


def _visible_devices(rank, world_size):
    import torch.distributed as dist

    return os.environ.get("CUDA_VISIBLE_DEVICES"), str(dist.get_backend())


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_cpu_only_ranks_see_no_gpu_and_the_caller_keeps_its_own(start_method, monkeypatch):
    """A conversion and ``rlmega smoke`` run on the CPU also on a GPU node: their ranks see no device."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert run_on_ranks(_visible_devices, 2, timeout_s=120, cpu_only=True,
                        start_method=start_method) == [("", "gloo")] * 2
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert run_on_ranks(_visible_devices, 1, timeout_s=120, start_method=start_method) == [("0,1", "gloo")]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    run_on_ranks(_visible_devices, 1, timeout_s=120, cpu_only=True, start_method=start_method)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_the_default_backend_takes_cpu_tensors_beside_nccl(monkeypatch):
    """NCCL moves only CUDA tensors; the metrics and counts rlmega reduces on the host go over gloo."""
    import torch

    from rlmega.parallel.layout import default_backend

    assert default_backend() == ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_backend() == "cpu:gloo,cuda:nccl"


def test_an_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="start_method must be 'forkserver' or 'spawn', got 'fork'"):
        run_on_ranks(_all_reduce_rank, 1, start_method="fork")


def test_results_come_back_per_rank():
    results = run_on_ranks(_all_reduce_rank, 2, timeout_s=60)
    assert results == [(0, 2, 3.0), (1, 2, 3.0)]


def test_raising_rank_is_reported_with_its_traceback():
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_raise_on_rank_one, 2, timeout_s=60)
    assert failure.value.rank == 1
    assert "ValueError: bad shard on purpose" in failure.value.detail
    assert "_raise_on_rank_one" in failure.value.detail  # the traceback, not just the message
    assert time.monotonic() - started < 60


def test_dead_rank_fails_the_run_naming_it():
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_die_on_rank_one, 2, timeout_s=60)
    assert failure.value.rank == 1
    assert "exited with code 3" in str(failure.value)


def test_hung_ranks_time_out_and_leave_no_processes(tmp_path):
    pid_file = tmp_path / "child.pid"
    run_on_ranks(_all_reduce_rank, 1, timeout_s=120)  # the fork server has imported torch before the clock starts
    started = time.monotonic()
    # 10 s: long enough for two forked ranks to start their children on a loaded machine.
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_sleep_with_child, 2, timeout_s=10, args=(str(pid_file),))
    assert "still running after 10s" in str(failure.value)
    assert time.monotonic() - started < 60
    grandchildren = [int(path.read_text()) for path in tmp_path.glob("child.pid.*")]
    assert len(grandchildren) == 2

    def alive():
        return [pid for pid in grandchildren
                if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive() == []
    leftover = [
        child for child in psutil.Process().children(recursive=True)
        if child.status() != psutil.STATUS_ZOMBIE
        # multiprocessing's resource tracker and fork server belong to this test process, not to a rank
        and "resource_tracker" not in " ".join(child.cmdline())
        and "forkserver" not in " ".join(child.cmdline())  # it forks ranks for this process; ends with it
    ]
    assert leftover == []

"""Under an address-space limit (``ulimit -v``) a run reads its data or fails in one line naming the file; Ctrl-C
ends a run, and a command stuck in native code, within seconds and on one line."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fault_helpers import ONE_RANK, TINY, wait_for

LIMIT_KB = 2_000_000
"""The ``ulimit -v`` a run was seen to hang under (in pyarrow's dataset scanner, deaf to Ctrl-C)."""
TIMEOUT_S = 120


def _train_limited(run_dir: Path, assets: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``rlmega train`` under ``ulimit -v LIMIT_KB``, killed if it outlives ``TIMEOUT_S``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "assets").exists():
        (run_dir / "assets").symlink_to(assets)
    arguments = " ".join(f"'{argument}'" for argument in [f"run_dir={run_dir}", *TINY, *ONE_RANK, *overrides])
    command = f"ulimit -v {LIMIT_KB}; exec '{sys.executable}' -m rlmega.cli train {arguments}"
    try:
        return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(f"the run did not end within {TIMEOUT_S} s under ulimit -v {LIMIT_KB}") from expired


def test_under_the_limit_the_data_is_read_and_checked(tmp_path, assets):
    """The run reaches the end of its checks (the prompt count is checked after every row is read and tokenized)."""
    result = _train_limited(tmp_path / "run", assets, "trainer.prompts_per_step=100000")
    assert (result.returncode, result.stderr.count("\n")) == (2, 1), result.stderr[-3000:]
    assert result.stderr.startswith("rlmega train: trainer.prompts_per_step: 100000 prompts per step, but data.files")


def test_a_file_that_does_not_fit_fails_in_one_line(tmp_path, assets):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # 1,500 rows sharing one 1 MiB note: a small file (stored once, as a dictionary) that decodes to 1.5 GiB.
    rows = 1500
    table = pa.Table.from_pylist([{"data_source": "rlmega/arithmetic", "prompt": [{"role": "user", "content": "1+2="}],
                                   "reward_model": {"style": "rule", "ground_truth": "3"}}] * rows)
    note = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(["x" * (1 << 20)]))
    big = tmp_path / "big.parquet"
    pq.write_table(table.append_column("note", note), big, store_schema=False)
    result = _train_limited(tmp_path / "run", assets, f"data.files=[{big}]")
    assert (result.returncode, result.stderr.count("\n")) == (2, 1), result.stderr[-3000:]
    assert result.stderr.startswith(f"rlmega train: out of memory while reading {big}: ")


def test_ctrl_c_ends_a_run(tmp_path, start_run):
    run = start_run("run", "trainer.total_steps=100", "cluster.in_process=auto")  # rank 0 here, rank 1 a child
    run.wait_step(1)
    run.snapshot()
    started = time.monotonic()
    os.killpg(run.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the foreground process group
    code = run.process.wait(timeout=60)
    assert (code, time.monotonic() - started < 30) == (130, True)
    output = run.output()
    assert output.rstrip("\n").splitlines()[-1] == "rlmega train: interrupted" and "Traceback" not in output
    run.assert_nothing_left()


STUCK = textwrap.dedent("""
    import ctypes, sys
    from rlmega.cli.interrupts import interrupts_end, print_interrupted

    mutex = ctypes.create_string_buffer(64)  # zeroed: an unlocked default pthread mutex
    lock = ctypes.CDLL(None).pthread_mutex_lock
    with interrupts_end("train"):
        try:
            lock(mutex)
            print("locking again", flush=True)
            lock(mutex)  # locked again by its owner: blocked in native code for good, as no signal ends the wait
        except KeyboardInterrupt:
            sys.exit(print_interrupted("train"))
""")


def _in_a_futex_wait(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] == "202"  # futex, on x86-64
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="reads the x86-64 system call number of the wait")
def test_ctrl_c_ends_a_command_stuck_in_native_code(tmp_path):
    from rlmega.cli.interrupts import GRACE_S

    process = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline() == "locking again\n"
        wait_for(lambda: _in_a_futex_wait(process.pid), 60, "the main thread blocked on the mutex", process)
        started = time.monotonic()
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=GRACE_S + 30)
    finally:
        process.kill()
        process.wait()
    assert code == 130 and time.monotonic() - started >= GRACE_S  # taken by the watch, not by the main thread
    assert process.stderr.read() == "rlmega train: interrupted\n"

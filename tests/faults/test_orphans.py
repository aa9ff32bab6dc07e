"""What a driver killed with SIGKILL leaves behind, without Ray: its guardian stops the processes it started
(also those orphaned before its death, those in sessions of their own and those that rewrote their environment
block), and nothing else; a reward worker whose pool's process dies kills itself and what its function started,
even in the middle of a call."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from fault_helpers import wait_for

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guardian reads /proc (Linux)")]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _driver(tmp_path, body: str) -> tuple[subprocess.Popen, list[int]]:
    """Run ``body`` in a fresh Python process that writes the pids it wants watched to ``pids``, one a line,
    then sleeps; returns it once the pids are written."""
    pids = tmp_path / "pids"
    script = tmp_path / "driver.py"
    script.write_text("import os, subprocess, sys, time\n" + textwrap.dedent(body) +
                      f"\nopen({str(pids)!r} + '.tmp', 'w').write('\\n'.join(map(str, watched)))\n"
                      f"os.replace({str(pids)!r} + '.tmp', {str(pids)!r})\ntime.sleep(600)\n")
    driver = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    try:
        wait_for(pids.exists, 60, "the driver's processes", driver)
    except BaseException:
        driver.kill()  # its guardian, if it started one, stops the rest
        driver.wait()
        raise
    return driver, [int(line) for line in pids.read_text().split()]


def test_guardian_stops_every_process_of_a_killed_driver_and_nothing_else(tmp_path):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    driver, watched = _driver(tmp_path, """
        from rlmega.launch.guardian import start_guardian
        start_guardian()
        # A child in a session of its own; a grandchild without the run token, in a session of its own, whose
        # parent exits with the driver (the raylet's agents after kill -9: re-parented to init, their
        # environment block overwritten by their new title); a grandchild orphaned while the driver still
        # lives (found by its token).
        session = subprocess.Popen(["sleep", "600"], start_new_session=True)
        middle = subprocess.Popen([sys.executable, "-c", "import os, subprocess, time\\n"
            "p = subprocess.Popen(['sleep', '600'], env={}, start_new_session=True, stdout=subprocess.DEVNULL)\\n"
            "print(p.pid, flush=True)\\n"
            "parent = os.getppid()\\n"
            "while os.getppid() == parent: time.sleep(0.05)\\n"], stdout=subprocess.PIPE, text=True)
        untokened = int(middle.stdout.readline())
        early = subprocess.Popen([sys.executable, "-c",
            "import subprocess; print(subprocess.Popen(['sleep', '600'], start_new_session=True, "
            "stdout=subprocess.DEVNULL).pid)"],
            stdout=subprocess.PIPE, text=True)
        orphan = int(early.communicate()[0])
        time.sleep(1.5)  # two records of the tree
        watched = [session.pid, middle.pid, untokened, orphan]
    """)
    try:
        assert all(_alive(pid) for pid in watched)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        wait_for(lambda: not any(_alive(pid) for pid in watched), 30, "the driver's processes to be stopped")
        assert _alive(bystander.pid)  # not started by the driver: untouched
    finally:
        bystander.kill()
        bystander.wait()
        for pid in watched:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_guardian_exits_with_a_driver_that_exits_normally(tmp_path):
    script = ("import subprocess, sys\nfrom rlmega.launch.guardian import start_guardian\nstart_guardian()\n"
              "print(subprocess.check_output(['pgrep', '-f', 'rlmega.launch.guardian .* ' + str(__import__('os')"
              ".getpid())], text=True).split()[0])\n")
    guardian = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                  timeout=60).stdout)
    wait_for(lambda: not _alive(guardian), 10, "the guardian to exit")


def test_reward_worker_dies_with_its_pool_process_even_mid_call(tmp_path):
    function = tmp_path / "reward.py"
    child = tmp_path / "child"
    function.write_text(textwrap.dedent(f"""
        import subprocess, time
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            open({str(child)!r}, "w").write(str(subprocess.Popen(["sleep", "600"]).pid))
            time.sleep(600)
    """))
    driver, watched = _driver(tmp_path, f"""
        import threading
        from rlmega.rewards.pool import ScoringPool
        pool = ScoringPool({str(function)!r} + ":compute_score", num_workers=1, timeout_s=600)
        pool.start()
        threading.Thread(target=pool.run, args=([("x", "1", "1", None)],), daemon=True).start()
        while not os.path.exists({str(child)!r}) or not open({str(child)!r}).read():
            time.sleep(0.05)
        watched = [pool._workers[0].process.pid, int(open({str(child)!r}).read())]
    """)
    try:
        assert all(_alive(pid) for pid in watched)
        started = time.monotonic()
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        wait_for(lambda: not any(_alive(pid) for pid in watched), 10, "the reward worker and its child to exit")
        assert time.monotonic() - started < 5
    finally:
        for pid in watched:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

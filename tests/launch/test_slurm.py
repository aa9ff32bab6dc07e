"""``launch/slurm/train.sbatch`` on the real single-node SLURM cluster of this machine
(``bash launch/slurm/local_cluster.sh start``; .ci/run starts it): a run to completion, and a run
preempted with SIGTERM that checkpoints, requeues itself and finishes."""

import re
import shutil
import subprocess
import time

import pytest
from launch_helpers import (
    REPO,
    VENV_BIN,
    assert_finished,
    free_ports,
    latest_checkpoint,
    launch_env,
    read_metrics,
)

pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.skipif(shutil.which("sbatch") is None,
                       reason="SLURM is not installed (no sbatch): bash launch/slurm/local_cluster.sh start"),
]
SBATCH = REPO / "launch" / "slurm" / "train.sbatch"


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster():
    status = subprocess.run(["bash", str(REPO / "launch/slurm/local_cluster.sh"), "status"], timeout=60)
    assert status.returncode == 0, (
        "sbatch is installed but this host's SLURM node is not up: bash launch/slurm/local_cluster.sh start")


def job_state(job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_state(job_id: str, done, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = job_state(job_id)
        if done(state):
            return state
        assert time.monotonic() < deadline, f"job {job_id}: no {what} after {timeout:.0f}s: {state}"
        time.sleep(1)


def finished(state: dict) -> bool:
    return state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                     "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.fixture
def submit(scratch, driver):
    """sbatch train.sbatch with this test's RUN_DIR, ports and trainer; scancel at the end."""
    jobs = []

    def run(*overrides: str, grace: int = 120) -> str:
        gcs, dashboard, client, agent = free_ports(4)
        env = launch_env(
            RUN_DIR=str(scratch / "run"), CONFIG="tiny_cpu", RLMEGA_ROOT=str(REPO),
            RLMEGA_VENV=str(VENV_BIN.parent), RLMEGA_CMD=" ".join(driver.command),
            RAY_PORT=str(gcs), RAY_DASHBOARD_PORT=str(dashboard), RAY_INCLUDE_DASHBOARD="false",
            RAY_TMPDIR=str(scratch / "ray"), STOP_GRACE=str(grace),
            # tiny_cpu's two colocated ranks ask Ray for 4 CPUs; this node may have 2.
            RAY_NUM_CPUS="4",
            RAY_START_ARGS=f"--ray-client-server-port={client} --dashboard-agent-listen-port={agent}",
        )
        result = subprocess.run(
            ["sbatch", "--parsable", f"--output={scratch}/sbatch-%j.out", str(SBATCH), *overrides],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        job_id = result.stdout.strip().split(";")[0]
        jobs.append(job_id)
        return job_id

    yield run
    for job_id in jobs:
        subprocess.run(["scancel", job_id], timeout=30)
    for job_id in jobs:
        wait_state(job_id, lambda s: s.get("JobState") not in ("RUNNING", "COMPLETING", "PENDING"), 60,
                   "end after scancel")


def job_log(scratch, job_id: str) -> str:
    path = scratch / "run" / "logs" / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else "(no log)"


def test_sbatch_runs_the_tiny_job(scratch, driver, submit):
    started = time.monotonic()
    job_id = submit(*driver.overrides(total_steps=3))
    state = wait_state(job_id, finished, 300, "completion")
    log = job_log(scratch, job_id)
    assert state["JobState"] == "COMPLETED", log[-5000:]
    run_dir = scratch / "run"
    assert_finished(run_dir, 3)
    assert (run_dir / "placement.json").exists()
    assert "all 1 Ray nodes joined" in log
    assert list((run_dir / "logs" / "ray").glob("*-head-restart0")), "the head's Ray logs are copied"
    print(f"sbatch to completion: {time.monotonic() - started:.1f}s")
    if driver.name == "real":  # the stand-in's checkpoints are not Megatron checkpoints
        convert_latest_checkpoint(scratch, run_dir)


def convert_latest_checkpoint(scratch, run_dir):
    """convert.sbatch exports the run's latest checkpoint next to it, from RUN_DIR alone."""
    result = subprocess.run(
        ["sbatch", "--parsable", f"--output={scratch}/convert-%j.out", str(REPO / "launch/slurm/convert.sbatch")],
        env=launch_env(RUN_DIR=str(run_dir), RLMEGA_ROOT=str(REPO), RLMEGA_VENV=str(VENV_BIN.parent)),
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    try:
        state = wait_state(job_id, finished, 200, "conversion")
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
    log = (run_dir / "logs" / f"convert-{job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED", log[-3000:]
    exported = run_dir / "converted" / f"iter_{latest_checkpoint(run_dir):07d}"
    assert (exported / "config.json").exists() and list(exported.glob("*.safetensors")), log[-3000:]


def test_sigterm_checkpoints_requeues_and_finishes(scratch, driver, submit):
    # The preemption must land before the run ends on its own: the stub's steps take 3 s each; the real tiny
    # steps take well under a second, so the real run gets enough of them that the signal's trip through
    # slurmd and the batch script (about a second) cannot outlast it (5 steps once did, on an idle machine).
    total_steps = 6 if driver.name == "stub" else 40
    job_id = submit(*driver.overrides(total_steps=total_steps, slow=True))
    run_dir = scratch / "run"
    # Preempt once the first step is done, as SLURM's --signal=B:TERM@... would before the limit.
    deadline = time.monotonic() + 240
    while not read_metrics(run_dir):
        assert not finished(job_state(job_id)), job_log(scratch, job_id)[-5000:]
        assert time.monotonic() < deadline, "no training step within 240s: " + job_log(scratch, job_id)[-3000:]
        time.sleep(1)
    subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], check=True, timeout=30)

    wait_state(job_id, lambda s: s.get("Restarts", "0") != "0" or finished(s), 200, "requeue")
    log = job_log(scratch, job_id)
    saved = re.search(r"preempted: checkpoint saved at step (\d+)", log)
    assert saved, log[-5000:]
    preempted_at = int(saved.group(1))
    assert preempted_at < total_steps
    assert latest_checkpoint(run_dir) == preempted_at
    assert "requeueing job" in log
    # SLURM holds a requeued job for a while (BeginTime); let it start soon instead. Not at once:
    # slurmd revokes the old run's credential with one-second resolution, and a new run allocated
    # within that second is killed ("Job credential revoked"). So wait until the old run has left
    # the node (PENDING), then start a few seconds later.
    wait_state(job_id, lambda s: s.get("JobState") == "PENDING" or finished(s), 120, "pending requeue")
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+3"], timeout=30)

    state = wait_state(job_id, finished, 300, "completion after the requeue")
    log = job_log(scratch, job_id)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (
        f"{state.get('JobState')} {state.get('Reason')} restarts {state.get('Restarts')}\n" + log[-5000:])
    assert_finished(run_dir, total_steps)
    steps = [row["step"] for row in read_metrics(run_dir)]
    assert steps[-1] == total_steps and preempted_at + 1 in steps, steps
    assert latest_checkpoint(run_dir) == total_steps

"""Fixtures of the launcher tests: which trainer runs, and a scratch dir whose processes are killed.

The driver is ``rlmega train`` once it exists in this checkout (``rlmega train --help`` exits 0), else
the stand-in ``tests/launch/stub_rlmega.py`` with the same command line and outputs.
``RLMEGA_LAUNCH_DRIVER=stub|real`` forces one (``real`` fails when the trainer is missing).
"""

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launch_helpers import STUB, VENV_BIN, Driver, kill_mentioning


@functools.lru_cache(maxsize=1)
def _real_trainer_available() -> bool:
    rlmega = shutil.which("rlmega", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if rlmega is None:
        return False
    probe = subprocess.run([rlmega, "train", "--help"], capture_output=True, timeout=120)
    return probe.returncode == 0


@pytest.fixture(scope="session")
def driver() -> Driver:
    choice = os.environ.get("RLMEGA_LAUNCH_DRIVER", "auto")
    real = choice == "real" or (choice == "auto" and _real_trainer_available())
    if choice == "real" and not _real_trainer_available():
        pytest.fail("RLMEGA_LAUNCH_DRIVER=real but `rlmega train --help` does not exit 0")
    if real:
        return Driver("real", [str(VENV_BIN / "rlmega")])
    return Driver("stub", [sys.executable, str(STUB)])


def pytest_report_header(config):
    choice = os.environ.get("RLMEGA_LAUNCH_DRIVER", "auto")
    return f"launch tests: driver {choice} (real trainer present: {_real_trainer_available()})"


@pytest.fixture
def scratch():
    """A short, unique temp dir (Ray puts Unix sockets under it); every process that mentions it
    is killed at the end, whatever the test's outcome."""
    path = Path(tempfile.mkdtemp(prefix="rlm-", dir="/tmp"))
    yield path
    kill_mentioning(str(path))
    time.sleep(0.5)
    kill_mentioning(str(path))
    shutil.rmtree(path, ignore_errors=True)



"""The minimal GPU tier with wheels of two megatron-core releases (``fetch_wheels.sh --every-mcore``): every check
runs once with each release, each pass with the other carried wheels too and never both releases at once. On CPU,
with a stand-in for the GPU machine's Python that reports which distributions the carried wheels put first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .test_gpu_runner import LIMIT_S, RUNNER, _fake_wheel

ROOT = Path(__file__).resolve().parents[2]

# CUDA is there and every check passes; "-" (the environment line) names the distributions first on PYTHONPATH.
FAKE_PYTHON = """#!/usr/bin/env bash
case "$1" in
    -) cat >/dev/null; site="${PYTHONPATH%%:*}"
       echo "environment: $(ls "$site" | sed -n 's/\\.dist-info$//p' | sort | tr '\\n' ' ')" ;;
    -c) exit 0 ;;
    -m) if [ "$2" = pip ]; then shift; exec "$REAL_PYTHON" -m "$@"; fi
        [ "$2" = pytest ] || exit 3
        echo "1 passed in 0.01s" ;;
    *) exit 3 ;;
esac
"""


def test_each_carried_megatron_core_release_runs_every_check(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, version in (("megatron-core", "0.19.2"), ("megatron-core", "0.16.1"), ("safetensors", "9.9.9")):
        _fake_wheel(wheels, name, version)
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), REAL_PYTHON=sys.executable)
    result = subprocess.run(["bash", str(RUNNER), "--wheels", str(wheels)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=LIMIT_S)
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    environments = [line.strip() for line in lines if line.startswith("environment:")]
    assert environments == ["environment: megatron_core-0.16.1 safetensors-9.9.9",
                            "environment: megatron_core-0.19.2 safetensors-9.9.9"], lines
    checks = subprocess.run(["bash", str(RUNNER), "--list"], cwd=ROOT, capture_output=True, text=True,
                            timeout=LIMIT_S).stdout.split()
    passed = [line.split()[1] for line in lines if line.startswith("PASS ")]
    assert passed == checks + checks, lines
    assert re.search(rf"^tier minimal: {2 * len(checks)} passed, 0 failed, 0 skipped$", result.stdout, re.M), lines

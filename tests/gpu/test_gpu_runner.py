"""The GPU checks' runner and its wheels, on CPU: what could break them before they ever reach a GPU.

- Every check of tests/gpu/run_gpu_checks.sh names a gpu-marked test that exists: a renamed test would
  otherwise turn a check into "no tests ran" on the GPU machine.
- ``--wheels DIR`` puts the carried wheels ahead of the machine's own packages (a wheel of a made-up
  megatron-core version shows in the environment line), and a machine without CUDA fails at once.
- tests/gpu/fetch_wheels.sh fetches megatron-core, in setup.py's range, for another Python (needs the index).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from rollout.test_engine_pins import needs_index, setup_requirements  # setup.py's pins, the index's reachability

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "gpu" / "run_gpu_checks.sh"
LIMIT_S = 300


def _checks() -> list[tuple[str, str]]:
    """(check name, pytest node id) of every check the runner names, both tiers."""
    text = RUNNER.read_text()
    return re.findall(r'"([\w$-]+(?:\[\$1\])?[\w-]*)\|(tests/[^"]+)"', text)


def _resolved(node: str) -> list[str]:
    """A node id with the engine placeholder ``$1`` filled in for each engine."""
    return [node.replace("$1", engine) for engine in ("vllm", "sglang")] if "$1" in node else [node]


def test_every_check_names_an_existing_gpu_test():
    nodes = [node for _, entry in _checks() for node in _resolved(entry) if "::" in node]
    assert len(nodes) >= 15, _checks()  # the parse found the checks: 10 minimal, engine and TE ones
    for node in nodes:
        path, function = node.split("::")
        function = function.split("[")[0]
        source = (ROOT / path).read_text()
        tree = ast.parse(source)
        found = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == function]
        assert found, f"{node}: no test function {function} in {path}"
        marked = "pytestmark = pytest.mark.gpu" in source or any(
            "gpu" in ast.unparse(decorator) for decorator in found[0].decorator_list)
        assert marked, f"{node} is not marked gpu: the runner selects with -m gpu and would run nothing"
    files = [node for _, entry in _checks() for node in _resolved(entry) if "::" not in node]
    assert files and all((ROOT / path).is_file() for path in files), files


def test_each_minimal_tier_check_collects_its_tests():
    minimal = subprocess.run(["bash", str(RUNNER), "--list"], capture_output=True, text=True, timeout=LIMIT_S)
    names = minimal.stdout.split()
    nodes = dict(_checks())
    assert names and all(name in nodes for name in names), minimal
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "-m", "gpu", *(nodes[name] for name in names)],
                            cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S)
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    for name in names:  # pytest prints ids relative to tests/ (its rootdir); a parametrized test gives several
        node = nodes[name].removeprefix("tests/")
        assert any(line == node or line.startswith(node + "[") for line in collected), (name, result.stdout)


def _fake_wheel(directory: Path, name: str, version: str) -> Path:
    """A pure-Python wheel of ``name`` at ``version`` holding an empty module."""
    stem = f"{name.replace('-', '_')}-{version}"
    wheel = directory / f"{stem}-py3-none-any.whl"
    info = f"{stem}.dist-info"
    files = {
        "rlmega_wheel_probe.py": "",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def test_carried_wheels_come_first_and_a_machine_without_cuda_fails_at_once(tmp_path):
    _fake_wheel(tmp_path, "megatron-core", "0.0.1")
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(["bash", str(RUNNER), "--wheels", str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=LIMIT_S)
    assert result.returncode == 1, result
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"environment: Python {sys.version.split()[0]}, torch "), lines
    assert "megatron-core 0.0.1" in lines[0], lines  # the carried wheel, not the installed 0.16
    assert lines[1] == f"FAIL cuda-visible: {sys.executable} sees no CUDA device", lines
    assert len(lines) == 2 and result.stderr == "", result


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for the GPU machine's Python: CUDA is there, every check passes and measures, but the hf engine's fails.
case "$1" in
    -) cat >/dev/null; echo "environment: fake" ;;
    -c) exit 0 ;;
    -m) [ "$2" = pytest ] || exit 3
        if [[ "$*" == *test_hf_engine_on_gpu_in_bf16* ]]; then
            echo "rescored_max=0.5" >>"$RLMEGA_GPU_MEASURES"; echo "E   assert 0.5 <= 0.1"; echo "1 failed in 0.01s"; exit 1
        fi
        echo "cosine=0.999" >>"$RLMEGA_GPU_MEASURES"; echo "mib=29.3" >>"$RLMEGA_GPU_MEASURES"; echo "1 passed in 0.01s" ;;
    *) exit 3 ;;
esac
"""


def _run_with_fake_python(tmp_path, *args):
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return subprocess.run(["bash", str(RUNNER), *args], cwd=ROOT, env=dict(os.environ, PYTHON=str(python)),
                          capture_output=True, text=True, timeout=LIMIT_S)


def test_each_check_line_carries_what_it_measured_and_failures_name_their_rerun(tmp_path):
    result = _run_with_fake_python(tmp_path)
    assert result.returncode == 1, result
    lines = [line for line in result.stdout.splitlines() if line[:4] in ("PASS", "FAIL")]
    names = subprocess.run(["bash", str(RUNNER), "--list"], capture_output=True, text=True,
                           timeout=LIMIT_S).stdout.split()
    assert [line.split()[1] for line in lines] == names
    for line in lines:
        if line.startswith("PASS"):
            assert re.fullmatch(r"PASS [\w-]+ \(\d+s\): cosine=0\.999 mib=29\.3", line), line
    assert re.fullmatch(r"FAIL hf-engine-cuda-bf16 \(\d+s\): 1 failed in 0\.01s \(measured: rescored_max=0\.5\)",
                        lines[names.index("hf-engine-cuda-bf16")]), lines
    tail = result.stdout.splitlines()[-2:]
    assert tail == ["tier minimal: 10 passed, 1 failed, 0 skipped (failed: hf-engine-cuda-bf16)",
                    "rerun the failed checks with: --only hf-engine-cuda-bf16"], tail


def test_only_runs_the_named_checks_and_refuses_an_unknown_name(tmp_path):
    result = _run_with_fake_python(tmp_path, "--only", "bridge-export-cuda-bf16,worker-logprobs-vs-transformers")
    assert result.returncode == 0, result
    ran = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("PASS")]
    assert ran == ["worker-logprobs-vs-transformers", "bridge-export-cuda-bf16"], result.stdout  # the tier's order
    assert result.stdout.splitlines()[-1] == "tier minimal: 2 passed, 0 failed, 0 skipped"

    result = _run_with_fake_python(tmp_path, "--only", "bridge-export")
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.strip() == ("--only: no check 'bridge-export' in tier minimal "
                                     "(see: bash tests/gpu/run_gpu_checks.sh --tier minimal --list)")


def test_measured_formats_numbers_and_writes_only_for_the_runner(tmp_path, monkeypatch):
    import torch

    from gpu.measures import ENV, measured

    monkeypatch.delenv(ENV, raising=False)
    line = measured(cosine=torch.tensor(0.99871), bytes=30_693_888, count=12, ok=True, kind="llama")
    assert line == "cosine=0.999 bytes=30_693_888 count=12 ok=True kind=llama"
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(ENV, str(tmp_path / "measures"))
    measured(worst=0.0123)
    measured(mib=29.27)
    assert (tmp_path / "measures").read_text() == "worst=0.0123\nmib=29.3\n"


def test_the_runner_refuses_an_empty_wheels_folder(tmp_path):
    result = subprocess.run(["bash", str(RUNNER), "--wheels", str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=LIMIT_S)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"--wheels: no .whl files in '{tmp_path}' "
                                     f"(make them with: bash tests/gpu/fetch_wheels.sh --dest {tmp_path})")


@needs_index
def test_fetch_wheels_brings_megatron_core_for_the_gpu_machines_python(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "fetch_wheels.sh"), "--python-version", "3.12",
                             "--dest", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S)
    assert result.returncode == 0, result
    wheels = sorted(path.name for path in tmp_path.glob("*.whl"))
    assert len(wheels) == 1 and wheels[0].startswith("megatron_core-"), wheels
    assert "-cp312-cp312-" in wheels[0] and "x86_64" in wheels[0], wheels
    pinned = next(Requirement(r) for r in setup_requirements()[0] if r.startswith("megatron-core"))
    assert Version(wheels[0].split("-")[1]) in pinned.specifier, (wheels, pinned)
    assert result.stdout.rstrip().endswith(f"bash tests/gpu/run_gpu_checks.sh --wheels {tmp_path}"), result.stdout

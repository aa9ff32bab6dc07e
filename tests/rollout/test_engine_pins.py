"""The engine extras of setup.py install together with the rest of rlmega's pins, and the pinned engines
read the checkpoints that our transformers writes.

``test_extras_resolve`` runs pip's resolver over setup.py's requirements plus an engine extra and the ``gpu``
extra (transformer-engine), as a GPU user installs them, without installing or downloading any wheel:
``pip install --dry-run --ignore-installed`` with ``fast-deps``, which reads each wheel's metadata through HTTP
range requests (the multi-GB CUDA wheels are never fetched; the three resolutions run side by side, in one to
two minutes here). A resolution of ``[vllm,gpu]`` is one of ``[vllm]`` and of ``[gpu]`` too. It needs the
package index; without it the test skips. transformer-engine's torch extension is published as an sdist only,
whose setup looks for the CUDA headers before it can even state its requirements: without a CUDA toolkit
(``CUDA_HOME``, ``nvcc`` on the PATH or /usr/local/cuda), as on a GPU user's machine without one, pip cannot
resolve ``[gpu]`` at all, so there the engines resolve without it and the transformer-engine check skips.
``test_a_conflicting_pin_fails`` proves the check can fail: the torch bound rlmega had before
(``<2.14``) cannot go with vllm 0.33, which pins torch 2.14.0.

The other tests read the API snapshot (fakes/api/*.json, from the wheels) and need neither the index nor
the wheels.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from setup_requirements import setup_requirements

from .fakes import api_snapshot
from .tiny_models import save_tiny_model


def start_resolve(requirements: list[str], directory: Path) -> subprocess.Popen:
    """pip's resolver over ``requirements``, started (its report goes to ``directory/report.json``)."""
    requirements_file = directory / "requirements.txt"
    requirements_file.write_text("\n".join(requirements) + "\n")
    return subprocess.Popen(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--use-feature=fast-deps", "--report", str(directory / "report.json"), "-r", str(requirements_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


RESOLVE_LIMIT_S = 600.0
"""For all the resolutions together: they run side by side."""


def finish(process: subprocess.Popen, deadline: float) -> subprocess.CompletedProcess:
    """``process``'s outcome; killed, and saying so, if it is still running at ``deadline`` (``time.monotonic()``)."""
    try:
        stdout, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        stderr += f"\n(pip did not finish within {RESOLVE_LIMIT_S:.0f} s)"
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _index_reachable() -> bool:
    result = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "packaging"], capture_output=True,
                            text=True, timeout=120)
    return result.returncode == 0


needs_index = pytest.mark.skipif(not _index_reachable(), reason="the package index is not reachable")


def cuda_toolkit() -> str | None:
    """Where transformer-engine's setup would look for the CUDA headers (its lookup order), or None."""
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), nvcc and str(Path(nvcc).parents[1]), "/usr/local/cuda"]
    return next((where for where in candidates if where and Path(where).is_dir()), None)


needs_cuda_toolkit = pytest.mark.skipif(
    cuda_toolkit() is None, reason="transformer-engine-torch (an sdist) needs a CUDA toolkit to state its "
    "requirements: set CUDA_HOME or put nvcc on the PATH")


CONFLICT = "conflicting-torch-pin"
ENGINES = ("vllm", "sglang")


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Each extra's resolution and the deliberately conflicting one, run side by side: pip spends them
    waiting on the index, so three at once take about as long as one."""
    install_requires, extras = setup_requirements()
    pinned = [("torch>=2.6,<2.14" if Requirement(r).name == "torch" else r) for r in install_requires]
    gpu = extras["gpu"] if cuda_toolkit() else []
    wanted = {engine: install_requires + extras[engine] + gpu for engine in ENGINES}
    wanted[CONFLICT] = pinned + extras["vllm"]
    for version in release_versions("vllm")[1:]:  # each other release the extra admits resolves too
        wanted[f"vllm=={version}"] = install_requires + extras["vllm"] + [f"vllm=={version}"] + gpu
    started = {}
    deadline = time.monotonic() + RESOLVE_LIMIT_S
    for name, requirements in wanted.items():
        directory = tmp_path_factory.mktemp(name)
        started[name] = start_resolve(requirements, directory), directory
    return {name: (finish(process, deadline), directory) for name, (process, directory) in started.items()}


@needs_index
@pytest.mark.parametrize("engine", ENGINES)
def test_extras_resolve(engine, resolutions):
    result, directory = resolutions[engine]
    assert result.returncode == 0, f"rlmega[{engine}] does not resolve:\n{result.stderr[-4000:]}"
    assert report_installs(directory)[engine]["version"] in release_versions(engine), \
        "no snapshot of the release pip picks: record it (engine_api_snapshot.py --suffix)"


@needs_index
def test_every_snapshotted_vllm_release_resolves(resolutions):
    """A conflict with rlmega's pins fails. A package the release pins that the index does not serve is an upstream
    gap, not ours, and is reported as an expected failure naming it (vllm 0.34.0 pins flashinfer-python==0.7.3,
    which PyPI did not have when 0.34 was recorded: pip then installs 0.33 for ``rlmega[vllm]``)."""
    unavailable = []
    for version in release_versions("vllm")[1:]:
        result, directory = resolutions[f"vllm=={version}"]
        missing = re.search(r"No matching distribution found for (\S+) \(from vllm\)", result.stderr)
        if result.returncode and missing and "ResolutionImpossible" not in result.stderr:
            unavailable.append(f"vllm {version} pins {missing.group(1)}, which the index does not serve")
            continue
        assert result.returncode == 0, f"rlmega[vllm] with vllm=={version} does not resolve:\n{result.stderr[-4000:]}"
        assert report_installs(directory)["vllm"]["version"] == version
    if unavailable:
        pytest.xfail("; ".join(unavailable))


def release_snapshots(package: str) -> list[dict]:
    """The API snapshots of every release of ``package`` the adapter supports: the fakes' own first."""
    others = sorted(api_snapshot.API_DIR.glob(f"{package}-*.json"))
    return [api_snapshot.load(package)] + [json.loads(path.read_text()) for path in others]


def release_versions(package: str) -> list[str]:
    return [snapshot["version"] for snapshot in release_snapshots(package)]


def test_each_vllm_release_the_extra_admits_has_a_snapshot_with_the_adapters_calls():
    """vllm>=0.33,<0.35: a snapshot of each minor release, and every call and field the fakes bind to (those of the
    0.33 snapshot) is in the later one with the same parameters, none of them newly required."""
    _, extras = setup_requirements()
    admitted = Requirement(extras["vllm"][0]).specifier
    snapshots = release_snapshots("vllm")
    minors = {tuple(Version(s["version"]).release[:2]) for s in snapshots}
    assert all(admitted.contains(s["version"]) for s in snapshots)
    wanted = {(0, minor) for minor in range(30, 40) if admitted.contains(f"0.{minor}.0")}
    assert wanted == minors, f"the vllm extra {admitted} admits {sorted(wanted)}; snapshots of {sorted(minors)}"
    oldest = snapshots[0]
    for later in snapshots[1:]:
        for name, entry in oldest["signatures"].items():
            params = {p[0]: p[1] for p in entry["params"]}
            now = {p[0]: (p[1], p[3]) for p in later["signatures"][name]["params"]}
            assert all(now.get(param, (None,))[0] == kind for param, kind in params.items()), (later["version"], name)
            assert all(has_default or param in params for param, (_, has_default) in now.items()), (later["version"], name)
        for cls, entry in oldest["fields"].items():
            assert {f[0] for f in entry["fields"]} <= {f[0] for f in later["fields"][cls]["fields"]}, (later["version"], cls)
        assert set(oldest["constants"]["LogprobsMode"]) <= set(later["constants"]["LogprobsMode"])
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" in later["env"]  # the switch the adapter sets


@needs_index
@needs_cuda_toolkit
@pytest.mark.parametrize("engine", ENGINES)
def test_the_gpu_extra_resolves_with_each_engine(engine, resolutions):
    """The transformer-engine pip picks beside the engine is one the megatron-core it picks was tested with."""
    result, directory = resolutions[engine]
    assert result.returncode == 0, f"rlmega[{engine},gpu] does not resolve:\n{result.stderr[-4000:]}"
    installs = report_installs(directory)
    assert megatron_te_range(installs["megatron-core"]["requires_dist"]).contains(
        installs["transformer-engine"]["version"], prereleases=True)


def report_installs(directory: Path) -> dict[str, dict]:
    """What pip's report says it would install, by normalised name."""
    return {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]
            for item in json.loads((directory / "report.json").read_text())["install"]}


@needs_index
def test_a_conflicting_pin_fails(resolutions):
    result, _ = resolutions[CONFLICT]
    assert result.returncode != 0 and "ResolutionImpossible" in result.stderr + result.stdout


def megatron_te_range(requires_dist: list[str]) -> SpecifierSet:
    """The transformer-engine versions a megatron-core release declares (its ``dev`` extra)."""
    for line in requires_dist:
        requirement = Requirement(line)
        if requirement.name.lower().replace("_", "-") == "transformer-engine":
            return requirement.specifier
    raise AssertionError(f"megatron-core declares no transformer-engine: {requires_dist}")


def test_the_gpu_extra_stays_inside_the_transformer_engine_range_of_megatron_core():
    """Offline: every transformer-engine our ``gpu`` extra admits is one the installed megatron-core declares
    (0.16: >=2.9.0a0,<2.12.0; rlmega had >=2.4,<2.9, which it never tested with)."""
    _, extras = setup_requirements()
    ours = Requirement(extras["gpu"][0]).specifier
    theirs = megatron_te_range(importlib.metadata.requires("megatron-core"))
    releases = [f"{major}.{minor}.{patch}" for major in (1, 2, 3) for minor in range(40) for patch in (0, 1, 5)]
    admitted = [version for version in releases if ours.contains(version)]
    assert admitted, f"the gpu extra {ours} admits no release"
    outside = [version for version in admitted if not theirs.contains(version, prereleases=True)]
    assert not outside, f"the gpu extra {ours} admits {outside}, outside megatron-core's {theirs}"


@pytest.mark.parametrize("package", ENGINES)
def test_our_pins_admit_the_engine_pins(package):
    """Offline half of the resolver check: the engine's own pins on torch and transformers (from its wheel)
    meet ours. vllm 0.11 with transformers 5 (it declared no upper bound) is the pairing this rules out."""
    install_requires, extras = setup_requirements()
    ours = {Requirement(r).name: Requirement(r).specifier for r in install_requires}
    for api in release_snapshots(package):
        _check_engine_pins(api, ours, Requirement(extras[package][0]).specifier)


def _check_engine_pins(api: dict, ours: dict, extra: SpecifierSet) -> None:
    package = api["package"]
    assert extra.contains(api["version"])
    for name, spec in api["requires"].items():
        engine = SpecifierSet(spec)
        pinned = [s.version for s in engine if s.operator in ("==", "===")]
        candidates = pinned or [s.version for s in engine if s.operator in (">=", ">")]
        assert any(ours[name].contains(Version(v)) and engine.contains(Version(v)) for v in candidates), \
            f"{package} {api['version']} needs {name}{spec}, rlmega allows {name}{ours[name]}"


def rope_keys_missing(engine_keys: list[str], config: dict) -> list[str]:
    """Keys the engine's model code reads for the RoPE base that a checkpoint's config does not carry."""
    text = config.get("text_config", config)
    return [key for key in engine_keys if key not in ("rope_scaling",) and key not in text]


@pytest.mark.parametrize("package", ["vllm", "sglang"])
@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_the_engine_reads_the_rope_base_our_transformers_writes(package, model, tmp_path):
    """transformers 5 writes ``rope_parameters`` (with ``rope_theta`` inside) and no top-level
    ``rope_theta``: an engine whose model code reads only ``rope_theta`` (vllm 0.11's llama.py) runs Llama-3
    and Qwen3-MoE with the wrong RoPE base, silently."""
    directory = save_tiny_model(model.replace("_", "-"), tmp_path, seed=0)
    config = json.loads((Path(directory) / "config.json").read_text())
    keys = api_snapshot.load(package)["rope_config_keys"][model]
    assert "rope_parameters" in keys or not rope_keys_missing(keys, config), \
        f"{package} reads {keys} for {model}; the checkpoint has {sorted(config)}"


def test_the_rope_check_catches_vllm_0_11(tmp_path):
    directory = save_tiny_model("llama", tmp_path, seed=0)
    config = json.loads((Path(directory) / "config.json").read_text())
    assert rope_keys_missing(["rope_theta"], config) == ["rope_theta"]  # what vllm 0.11's llama.py reads


def test_the_engines_pin_different_torches_so_they_need_separate_environments():
    """README: install ``.[vllm,gpu]`` or ``.[sglang,gpu]``, never both engines (their torch pins, from the wheels)."""
    pins = {engine: SpecifierSet(api_snapshot.load(engine)["requires"]["torch"]) for engine in ENGINES}
    candidates = [f"2.14.{patch}" for patch in range(10)]
    assert not [v for v in candidates if all(spec.contains(v) for spec in pins.values())], pins

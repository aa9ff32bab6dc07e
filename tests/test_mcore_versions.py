"""The supported megatron-core releases (0.16 through 0.19): one list in rlmega.parallel.mcore_version, the same
ranges in setup.py, a resolution that picks 0.16.x on Python 3.11 and 0.19.x + transformer-engine 2.20.x on 3.12,
and every Megatron name rlmega imports present in the installed release (this file runs in the default suite, on
0.16, and in the compatibility tier, ``launch/run_tests.sh --mcore 0.19``)."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from rlmega.parallel import mcore_version
from setup_requirements import setup_requirements

ROOT = Path(__file__).resolve().parents[1]


def requirements_on(python: str) -> dict[str, Requirement]:
    """setup.py's requirements and gpu extra that apply on Linux with ``python`` ("3.12"), by name, markers gone."""
    install_requires, extras = setup_requirements()
    applying = {}
    for line in install_requires + extras["gpu"]:
        requirement = Requirement(line)
        environment = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
                       "platform_system": "Linux", "extra": ""}
        if requirement.marker is None or requirement.marker.evaluate(environment):
            requirement.marker = None
            applying[requirement.name] = requirement
    return applying


def test_the_supported_releases_are_described_and_others_refused():
    assert mcore_version.describe(mcore_version.SUPPORTED) == "0.16.x through 0.19.x"
    assert mcore_version.describe(((0, 16), (0, 19))) == "0.16.x, 0.19.x"
    for version in ("0.16.1", "0.17.1", "0.18.2", "0.19.2+9ab3c5e"):
        mcore_version.require_checked(version, mcore_version.SUPPORTED, "unused")
    with pytest.raises(RuntimeError, match=r"^0\.16\.x through 0\.19\.x, not 0\.20\.0: megatron-core>=0\.16,<0\.20$"):
        mcore_version.require_checked("0.20.0", mcore_version.SUPPORTED, "{checked}, not {version}: {install}")


@pytest.mark.parametrize("python, mcore, transformer_engine", [("3.11", (0, 16), "2.11.0"), ("3.12", (0, 19), "2.20.2")])
def test_setup_py_gives_each_python_its_megatron_pair(python, mcore, transformer_engine):
    """What pip can choose on each Python (0.17 and later need 3.12) is a pair mcore_version supports."""
    requirements = requirements_on(python)
    megatron = requirements["megatron-core"].specifier
    assert all(f"{a}.{b}.0" in megatron for a, b in mcore_version.SUPPORTED)
    assert "0.15.3" not in megatron and "0.20.0" not in megatron
    assert requirements["megatron-core"] == Requirement(mcore_version.PIP_RANGE)  # what refusals tell to install
    lowest, below = mcore_version.TRANSFORMER_ENGINE[mcore]
    te = requirements["transformer-engine"].specifier
    assert set(map(str, te)) == {f">={lowest[0]}.{lowest[1]}", f"<{below[0]}.{below[1]}"}
    assert transformer_engine in te
    assert ("triton" in requirements) == (mcore >= (0, 18))  # 0.18 and later import it; CPU torch lacks it


def _index_reachable() -> bool:
    result = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "packaging"], capture_output=True,
                            text=True, timeout=120)
    return result.returncode == 0


@pytest.mark.skipif(not _index_reachable(), reason="the package index is not reachable")
def test_pip_picks_megatron_core_0_16_on_python_3_11_and_0_19_with_transformer_engine_2_20_on_3_12(tmp_path):
    """pip's choice among the releases the index has, for a Linux x86-64 machine with each Python, side by side.
    Dependencies are not followed: torch's CUDA wheels and transformer-engine's torch extension (an sdist that
    needs a CUDA toolkit) cannot be resolved on a CPU machine; tests/rollout/test_engine_pins.py resolves the
    whole graph on this machine's Python. pip evaluates markers for the running Python, so they are applied here."""
    names = ("megatron-core", "transformer-engine")
    started = {}
    for python in ("3.11", "3.12"):
        requirements = requirements_on(python)
        report = tmp_path / f"{python}.json"
        started[python] = report, subprocess.Popen(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--no-deps",
             "--only-binary=:all:", "--python-version", python, "--platform", "manylinux_2_28_x86_64",
             "--report", str(report), *(str(requirements[name]) for name in names)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    chosen = {}
    for python, (report, process) in started.items():
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        installs = json.loads(report.read_text())["install"]
        chosen[python] = {entry["metadata"]["name"].replace("_", "-"): Version(entry["metadata"]["version"])
                          for entry in installs}
    assert chosen["3.11"]["megatron-core"].release[:2] == (0, 16)
    assert chosen["3.11"]["transformer-engine"].release[:2] == (2, 11)
    assert chosen["3.12"]["megatron-core"].release[:2] == (0, 19)
    assert chosen["3.12"]["transformer-engine"].release[:2] == (2, 20)


def _megatron_names_rlmega_imports() -> set[tuple[str, str]]:
    """(module, name) of every ``from megatron... import name`` in rlmega and converters."""
    found = set()
    for path in [*(ROOT / "rlmega").rglob("*.py"), *(ROOT / "converters").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
                found.update((node.module, alias.name) for alias in node.names)
    return found


def test_every_megatron_name_rlmega_imports_is_in_the_installed_release():
    import megatron.core

    assert mcore_version.installed() in mcore_version.SUPPORTED, megatron.core.__version__
    names = _megatron_names_rlmega_imports()
    assert ("megatron.core.transformer.moe.router_replay", "RouterReplay") in names  # the walk finds imports
    missing = []
    for module_name, name in sorted(names):
        module = importlib.import_module(module_name)
        if not hasattr(module, name) and importlib.util.find_spec(f"{module_name}.{name}") is None:
            missing.append(f"{module_name}.{name}")
    assert not missing, f"megatron-core {megatron.core.__version__} lacks {missing}"


def test_the_compatibility_tier_refuses_a_release_it_has_no_wheel_for():
    for args in (["bash", "launch/setup_mcore_env.sh", "0.20"], ["bash", "launch/setup_mcore_env.sh"]):
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert len(done.stderr.strip().splitlines()) == 1
        assert "0.17|0.18|0.19" in done.stderr and "Traceback" not in done.stderr


def test_mtp_layers_get_canonical_names_on_the_installed_release():
    """An MTP layer's transformer layer is ``transformer_layer`` in rlmega's names whatever Megatron calls it."""
    import inspect

    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    from rlmega.models import mtp_model

    attribute = mtp_model.inner_layer_attribute()
    assert attribute == ("mtp_model_layer" if mcore_version.installed() >= (0, 17) else "transformer_layer")
    assert f"self.{attribute} = " in inspect.getsource(MultiTokenPredictionLayer.__init__)
    assert mtp_model.canonical_inner_name(f"{attribute}.mlp.linear_fc1.weight") == "transformer_layer.mlp.linear_fc1.weight"
    assert mtp_model.canonical_inner_name("enorm.weight") == "enorm.weight"


def test_attention_without_a_query_down_projection_keeps_the_plain_query_projection():
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from rlmega.models.mla_query import attention_without_query_norm

    attention = attention_without_query_norm()
    resolves = hasattr(MLASelfAttention, "_resolve_qk_norm_config")  # 0.19's QKNormConfigResolver
    assert resolves == (mcore_version.installed() >= (0, 19))
    assert (attention is MLASelfAttention) == (not resolves)
    assert issubclass(attention, MLASelfAttention)

"""`rlmega` CLI and `rlmega doctor`: the real run on this machine, and every rule on fabricated reports."""

import copy
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rlmega
from rlmega.cli import doctor
from rlmega.cli.main import SUBCOMMANDS, main

DOCTOR = [sys.executable, "-m", "rlmega.cli.main", "doctor"]
REQUIRED_KEYS = {
    "rlmega",
    "python",
    "platform",
    "packages",
    "apex",
    "cuda",
    "distributed_backend",
    "cpu_platform",
    "problems",
    "missing_required",
}


def healthy_report() -> dict:
    """A CPU machine with every required package in its tested range and no GPU-only extras."""
    packages = {dep.name: {"version": None, "required": dep.required} for dep in doctor.DEPENDENCIES}
    for dep in doctor.DEPENDENCIES:
        if dep.required:
            packages[dep.name]["version"] = "1.0.0"
    packages["torch"]["version"] = "2.13.0+cpu"
    packages["megatron-core"]["version"] = "0.16.1"
    return {
        "rlmega": "0.1.0",
        "python": {"version": "3.11.7", "executable": "/venv/bin/python"},
        "platform": "Linux-x86_64",
        "packages": packages,
        "apex": {"installed": False, "nvidia": False},
        "cuda": {
            "torch_error": None,
            "available": False,
            "built_with": None,
            "device_count": 0,
            "devices": [],
            "nccl": None,
        },
        "distributed_backend": "gloo",
        "cpu_platform": {
            "redirects_apply": True,
            "checked_megatron_core": ["0.16.x"],
            "megatron_core_checked": True,
            "refusal": None,
        },
    }


def _set_version(package, version):
    return lambda report: report["packages"][package].update(version=version)


def _unrelated_apex(report):
    report["packages"]["apex"]["version"] = "0.9.10.dev0"
    report["apex"] = {"installed": True, "nvidia": False}


def _cuda_build_without_gpu(report):
    report["packages"]["torch"]["version"] = "2.13.0+cu128"
    report["cuda"]["built_with"] = "12.8"


def _cpu_refuses_megatron_core(report):
    report["cpu_platform"].update(megatron_core_checked=False, refusal="checked on 0.16.x, not 0.15.0")


def _sharded_rdt_on_old_ray(report):
    report["packages"]["vllm"]["version"] = "0.33.0"
    report["packages"]["ray"]["version"] = "2.40.0"


def _sharded_rdt_without_nixl(report):
    report["packages"]["vllm"]["version"] = "0.34.0"
    report["packages"]["ray"]["version"] = "2.60.0"


def _on_mcore_0_19_with(transformer_engine):
    def change(report):
        report["packages"]["megatron-core"]["version"] = "0.19.2"
        report["packages"]["transformer-engine"]["version"] = transformer_engine
    return change


MCORE_FIX = "pip install 'megatron-core>=0.16,<0.20' (0.16.x on Python 3.11, 0.19.x on 3.12)"

# (rule, how to break the healthy report, a fragment of the fix the message must name)
RULE_CASES = [
    ("python_too_old", lambda r: r["python"].update(version="3.9.18"), "Python 3.10 or newer"),
    ("torch_untested", _set_version("torch", "2.15.0"), "pip install torch==2.13.0"),
    ("torch_untested", _set_version("torch", "2.5.1"), "pip install torch==2.13.0"),
    ("megatron_core_untested", _set_version("megatron-core", "0.20.0"), MCORE_FIX),
    ("megatron_core_untested", _set_version("megatron-core", "0.15.3"), MCORE_FIX),
    ("cpu_platform_refuses_megatron_core", _cpu_refuses_megatron_core, "checked on 0.16.x, not 0.15.0"),
    ("cuda_build_without_gpu", _cuda_build_without_gpu, "CUDA_VISIBLE_DEVICES"),
    (
        "transformer_engine_without_cuda",
        _set_version("transformer-engine", "2.8.0"),
        "pip uninstall transformer-engine",
    ),
    ("transformer_engine_untested", _set_version("transformer-engine", "2.8.0"),
     "pip install 'transformer-engine[pytorch]>=2.9,<2.12'"),
    ("transformer_engine_untested", _set_version("transformer-engine", "2.20.0"),
     "does not go with megatron-core 0.16.1, which goes with >=2.9,<2.12; "
     "fix: pip install 'transformer-engine[pytorch]>=2.9,<2.12'"),
    ("transformer_engine_untested", _on_mcore_0_19_with("2.11.0"),
     "does not go with megatron-core 0.19.2, which goes with >=2.12,<2.21; "
     "fix: pip install 'transformer-engine[pytorch]>=2.12,<2.21'"),
    ("vllm_without_cuda", _set_version("vllm", "0.11.0"), "pip uninstall vllm"),
    ("sglang_without_cuda", _set_version("sglang", "0.5.3"), "pip uninstall sglang"),
    ("vllm_unsupported", _set_version("vllm", "0.11.0"), "pip install 'vllm>=0.33,<0.35'"),
    ("sglang_unsupported", _set_version("sglang", "0.5.3"), "pip install 'sglang>=0.5.23,<0.5.24'"),
    ("unrelated_apex", _unrelated_apex, "pip uninstall apex, then build NVIDIA apex from source"),
    ("sharded_rdt_unavailable", _sharded_rdt_on_old_ray, "needs ray>=2.56 (installed: 2.40.0) and nixl (not "
                                                         "installed); fix: pip install 'rlmega[sharded_rdt]'"),
    ("sharded_rdt_unavailable", _sharded_rdt_without_nixl, "needs nixl (not installed); fix: pip install "
                                                           "'rlmega[sharded_rdt]'"),
]


def test_every_rule_has_a_case():
    assert {name for name, _, _ in RULE_CASES} == {rule.name for rule in doctor.RULES}


def test_healthy_report_has_no_problems():
    report = healthy_report()
    assert doctor.find_problems(report) == {}
    assert doctor.missing_required(report) == []


@pytest.mark.parametrize("rule, break_report, fix", RULE_CASES)
def test_rule_fires_on_its_bad_combination(rule, break_report, fix):
    report = healthy_report()
    break_report(report)
    problems = doctor.find_problems(report)
    assert rule in problems
    message = problems[rule]
    assert fix in message
    assert "\n" not in message and "?" not in message  # one line, every {field} filled in


def test_gpu_only_packages_are_fine_with_a_gpu():
    report = healthy_report()
    report["cuda"].update(available=True, built_with="12.8", device_count=1, devices=["H200"])
    report["cpu_platform"]["redirects_apply"] = False
    report["cpu_platform"].update(megatron_core_checked=False, refusal="unchecked")  # GPU: irrelevant
    for package, version in (("transformer-engine", "2.11.0"), ("vllm", "0.33.0"), ("sglang", "0.5.23"),
                             ("ray", "2.60.0"), ("nixl", "1.5.1")):
        report["packages"][package]["version"] = version
    report["packages"]["apex"]["version"] = "0.1"
    report["apex"] = {"installed": True, "nvidia": True}
    assert doctor.find_problems(report) == {}


@pytest.mark.parametrize("mcore, transformer_engine, verdict", [
    ("0.16.1", None, "supported; on GPU with transformer-engine >=2.9,<2.12"),
    ("0.16.1", "2.11.0", "supported"),
    ("0.19.2", "2.20.1", "supported"),
    ("0.17.1", "2.13.0", "supported"),
    ("0.19.2", "2.11.0", "not supported: megatron-core 0.19 goes with transformer-engine >=2.12,<2.21"),
    ("0.20.0", "2.20.1", "not supported: megatron-core 0.16.x through 0.19.x are"),
])
def test_doctor_reports_the_megatron_pair_and_whether_it_is_supported(mcore, transformer_engine, verdict, capsys):
    report = healthy_report()
    report["packages"]["megatron-core"]["version"] = mcore
    report["packages"]["transformer-engine"]["version"] = transformer_engine
    installed = f"{mcore} + {transformer_engine or 'no transformer-engine'}"
    assert doctor.megatron_pair(report) == (installed, verdict)
    packages = doctor.report_rows(report)[1]
    assert ("megatron-core + transformer-engine", installed, verdict) in packages


def test_doctor_json_has_the_megatron_pair(monkeypatch, capsys):
    report = healthy_report()
    report["packages"]["megatron-core"]["version"] = "0.19.2"
    report["packages"]["transformer-engine"]["version"] = "2.20.1"
    monkeypatch.setattr(doctor, "collect_report", lambda: copy.deepcopy(report))
    assert main(["doctor", "--json"]) == 0
    pair = json.loads(capsys.readouterr().out)["megatron_pair"]
    assert pair == {"installed": "0.19.2 + 2.20.1", "supported": True, "verdict": "supported"}


def test_missing_required_package_names_its_install_command():
    report = healthy_report()
    report["packages"]["torch"]["version"] = None
    report["packages"]["megatron-core"]["version"] = None
    report["packages"]["tqdm"]["version"] = None
    missing = doctor.missing_required(report)
    assert len(missing) == 3
    torch_line, mcore_line, tqdm_line = missing
    assert "torch is not installed" in torch_line
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in torch_line
    assert mcore_line.endswith("fix: pip install 'megatron-core>=0.16,<0.20'")
    assert tqdm_line.endswith("fix: pip install tqdm")


def test_main_exits_1_and_prints_the_fix_when_a_required_package_is_missing(monkeypatch, capsys):
    report = healthy_report()
    report["packages"]["torch"]["version"] = None
    monkeypatch.setattr(doctor, "collect_report", lambda: copy.deepcopy(report))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "missing: torch is not installed" in out
    assert "pip install torch==2.13.0" in out
    assert "FAIL" in out

    assert main(["doctor", "--json"]) == 1
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["missing_required"][0].startswith("torch is not installed")


def test_warnings_alone_keep_exit_code_0(monkeypatch, capsys):
    report = healthy_report()
    report["packages"]["vllm"]["version"] = "0.11.0"
    monkeypatch.setattr(doctor, "collect_report", lambda: copy.deepcopy(report))
    assert main(["doctor"]) == 0
    assert "warning: vllm 0.11.0 is installed but torch sees no GPU" in capsys.readouterr().out


def test_plain_text_when_rich_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich", None)  # makes `from rich import ...` raise ImportError
    report = healthy_report()
    report["packages"]["rich"]["version"] = None
    doctor.print_report(report, doctor.find_problems(report), doctor.missing_required(report))
    out = capsys.readouterr().out
    assert "rich is not installed; fix: pip install rich" in out
    assert "gloo" in out


def test_collect_report_sees_this_environment():
    report = doctor.collect_report()
    assert report["packages"]["torch"]["version"] == importlib.metadata.version("torch")
    assert report["cuda"]["torch_error"] is None
    import torch

    assert report["cuda"]["available"] == torch.cuda.is_available()
    assert report["distributed_backend"] == ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    json.dumps(report)  # the --json contract: serialisable as is


def test_doctor_command_on_this_machine():
    result = subprocess.run(DOCTOR, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert importlib.metadata.version("torch") in result.stdout
    assert importlib.metadata.version("megatron-core") in result.stdout
    import torch

    assert ("nccl" if torch.cuda.is_available() else "gloo") in result.stdout
    assert "OK: every required package is installed" in result.stdout


def test_doctor_json_on_this_machine():
    result = subprocess.run(DOCTOR + ["--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert REQUIRED_KEYS <= report.keys()
    assert report["packages"]["megatron-core"]["version"] == importlib.metadata.version("megatron-core")
    assert report["missing_required"] == []


def test_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Megatron-Core" in out
    for name in SUBCOMMANDS:
        assert re.search(rf"^    {name}\b", out, re.MULTILINE)  # each subcommand listed with its help
    assert "check Python, dependencies and GPUs" in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rlmega {rlmega.__version__}"


def test_unknown_subcommand_is_a_usage_error(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'frobnicate'" in err
    assert "doctor" in err  # the message lists what is available


def test_no_subcommand_is_a_usage_error(capsys):
    assert main([]) == 2
    assert "required" in capsys.readouterr().err


def test_console_script_runs():
    script = Path(sys.executable).with_name("rlmega")
    assert script.exists(), f"no console script at {script}; install rlmega with `bash launch/setup_env.sh`"
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, f"rlmega {rlmega.__version__}")


def test_doctor_reports_a_torch_that_does_not_import(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    report = doctor.collect_report()
    assert report["cuda"]["torch_error"].startswith("ModuleNotFoundError")
    assert (report["distributed_backend"], report["cpu_platform"]) == (None, None)
    doctor.print_report(report, doctor.find_problems(report), doctor.missing_required(report))
    assert "torch does not import" in capsys.readouterr().out


def test_gpu_facts_are_read_from_torch(monkeypatch):
    # No GPU here: fake the torch.cuda answers of a 2-GPU node to check the CUDA side of the report.
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"NVIDIA H200 #{index}")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    report = doctor.collect_report()
    assert report["cuda"]["devices"] == ["NVIDIA H200 #0", "NVIDIA H200 #1"]
    assert report["cuda"]["nccl"] == "2.27.3"
    assert report["distributed_backend"] == "cpu:gloo,cuda:nccl"
    assert report["cpu_platform"]["redirects_apply"] is False
    rows = dict((item, value) for section in doctor.report_rows(report) for item, value, _ in section)
    assert (rows["GPUs"], rows["NCCL"]) == ("2", "2.27.3")
    assert rows["CPU platform redirects"] == "not needed (CUDA)"

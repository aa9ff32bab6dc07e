"""``rlmega doctor``: report the Python environment, dependencies and accelerators, and name the fix
for every known-bad combination.

Three steps, each testable alone: ``collect_report()`` gathers facts into a JSON-ready dict,
``find_problems()`` applies the data-driven ``RULES`` to it, and ``missing_required()`` lists what
stops rlmega from running (exit code 1). Nothing here imports a package just to read its version,
and a missing or broken dependency is reported, not raised: reporting it is the point.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import platform
import re
import sys
from typing import Callable, Dict, List, Optional, Tuple

import rlmega
from rlmega.parallel import mcore_version
from rlmega.sync import sharded_rdt_needs

HELP = "check Python, dependencies and GPUs; name the fix for every known-bad setup"

# PyPI's Linux torch wheels bundle CUDA (gigabytes); the CPU build comes from PyTorch's own index.
TORCH_CPU_INSTALL = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


@dataclasses.dataclass(frozen=True)
class Dependency:
    """A package rlmega uses, with the distribution names its version is looked up by."""

    name: str
    required: bool = True
    distributions: Tuple[str, ...] = ()
    """Distribution names to try, in order; empty means just ``name``."""
    install: str = ""
    """Command that installs it when missing; empty means ``pip install <name>``."""

    @property
    def lookup_names(self) -> Tuple[str, ...]:
        return self.distributions or (self.name,)

    @property
    def install_command(self) -> str:
        return self.install or f"pip install {self.name}"


DEPENDENCIES = (
    Dependency("torch", install=f"{TORCH_CPU_INSTALL} (on GPU machines: pip install torch==2.13.0)"),
    Dependency("megatron-core", install=f"pip install '{mcore_version.PIP_RANGE}'"),
    Dependency("transformers"),
    Dependency("ray", install="pip install 'ray[default]'"),
    Dependency("hydra-core"),
    Dependency("omegaconf"),
    Dependency("safetensors"),
    Dependency("numpy"),
    Dependency("pyarrow"),
    Dependency("rich"),
    Dependency("tqdm"),
    Dependency("psutil"),
    Dependency(
        "transformer-engine", required=False, distributions=("transformer-engine", "transformer_engine")
    ),
    Dependency("apex", required=False),
    Dependency("vllm", required=False),
    Dependency("sglang", required=False),
    Dependency(sharded_rdt_needs.NIXL, required=False),
    Dependency("mbridge", required=False),
    Dependency("fastapi", required=False, install="pip install -e .[gateway]"),  # rlmega gateway
    Dependency("uvicorn", required=False, install="pip install -e .[gateway]"),
    Dependency("hypothesis", required=False),
    Dependency("pytest", required=False),
    Dependency("tensorboard", required=False),
    Dependency("wandb", required=False),
    Dependency("mlflow", required=False),
)


def _installed_version(distribution_names: Tuple[str, ...]) -> Optional[str]:
    for name in distribution_names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _apex_facts() -> Dict[str, bool]:
    """NVIDIA apex has ``apex.optimizers`` / ``apex.normalization``; the PyPI package "apex" has neither."""
    if importlib.util.find_spec("apex") is None:
        return {"installed": False, "nvidia": False}
    try:
        nvidia = any(
            importlib.util.find_spec(f"apex.{module}") is not None
            for module in ("optimizers", "normalization")
        )
    except Exception:  # finding a submodule runs apex/__init__.py, which may raise anything
        nvidia = False
    return {"installed": True, "nvidia": nvidia}


def _cuda_facts() -> dict:
    facts = {
        "torch_error": None,
        "available": False,
        "built_with": None,
        "device_count": 0,
        "devices": [],
        "nccl": None,
    }
    try:
        import torch
    except Exception as error:  # a missing or broken torch is reported, not raised
        facts["torch_error"] = f"{type(error).__name__}: {error}"
        return facts
    facts["built_with"] = torch.version.cuda
    facts["available"] = torch.cuda.is_available()
    if facts["available"]:
        facts["device_count"] = torch.cuda.device_count()
        facts["devices"] = [torch.cuda.get_device_name(i) for i in range(facts["device_count"])]
    if torch.version.cuda and torch.distributed.is_available() and torch.distributed.is_nccl_available():
        nccl = torch.cuda.nccl.version()
        facts["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return facts


def _cpu_platform_facts(megatron_core_version: Optional[str]) -> dict:
    from rlmega.parallel import cpu_platform

    refusal = None
    if megatron_core_version is not None:
        try:
            cpu_platform.check_mcore_version(megatron_core_version)
        except RuntimeError as error:
            refusal = str(error)
    return {
        "redirects_apply": cpu_platform.cpu_platform_needed(),
        "checked_megatron_core": [f"{a}.{b}.x" for a, b in cpu_platform.CHECKED_MCORE_VERSIONS],
        "megatron_core_checked": None if megatron_core_version is None else refusal is None,
        "refusal": refusal,
    }


def collect_report() -> dict:
    """Gather every fact doctor reports into a JSON-serialisable dict (imports torch, nothing heavier)."""
    packages = {
        dep.name: {"version": _installed_version(dep.lookup_names), "required": dep.required}
        for dep in DEPENDENCIES
    }
    cuda = _cuda_facts()
    backend, cpu = None, None
    if cuda["torch_error"] is None:  # rlmega.parallel needs an importable torch
        from rlmega.parallel.layout import default_backend

        backend = default_backend()
        cpu = _cpu_platform_facts(packages["megatron-core"]["version"])
    return {
        "rlmega": rlmega.__version__,
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "packages": packages,
        "apex": _apex_facts(),
        "cuda": cuda,
        "distributed_backend": backend,
        "cpu_platform": cpu,
    }


def _version(report: dict, package: str) -> Optional[str]:
    return report["packages"].get(package, {}).get("version")


def _major_minor(version: Optional[str]) -> Optional[Tuple[int, int]]:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


def _outside(version: Optional[str], lowest: Tuple[int, int], below: Tuple[int, int]) -> bool:
    """True when ``version`` is installed and its major.minor is not in [lowest, below)."""
    major_minor = _major_minor(version)
    return major_minor is not None and not lowest <= major_minor < below


def _release(version: str) -> str:
    return ".".join(f"{version}.0".split(".")[:2])


def _range(lowest: Tuple[int, int], below: Tuple[int, int]) -> str:
    return f">={_release('.'.join(map(str, lowest)))},<{_release('.'.join(map(str, below)))}"


def transformer_engine_range(report: dict) -> Optional[str]:
    """The transformer-engine range that goes with the installed megatron-core, or None where that is not
    installed or not supported (then its own rule speaks)."""
    pair = mcore_version.TRANSFORMER_ENGINE.get(_major_minor(_version(report, "megatron-core")))
    return None if pair is None else _range(*pair)


def megatron_pair(report: dict) -> Tuple[str, str]:
    """The installed (megatron-core, transformer-engine) pair as "0.19.2 + 2.20.1", and whether rlmega supports it."""
    mcore, te = _version(report, "megatron-core"), _version(report, "transformer-engine")
    installed = f"{mcore or 'no megatron-core'} + {te or 'no transformer-engine'}"
    if mcore is None:
        return installed, "not supported: megatron-core is missing"
    if _major_minor(mcore) not in mcore_version.SUPPORTED:
        return installed, f"not supported: megatron-core {mcore_version.describe(mcore_version.SUPPORTED)} are"
    te_range = transformer_engine_range(report)
    if te is None:
        return installed, f"supported; on GPU with transformer-engine {te_range}"
    if _outside(te, *mcore_version.TRANSFORMER_ENGINE[_major_minor(mcore)]):
        return installed, f"not supported: megatron-core {_release(mcore)} goes with transformer-engine {te_range}"
    return installed, "supported"


def _transformer_engine_mismatched(report: dict) -> bool:
    pair = mcore_version.TRANSFORMER_ENGINE.get(_major_minor(_version(report, "megatron-core")))
    return pair is not None and _outside(_version(report, "transformer-engine"), *pair)


def _cpu_platform_refuses(report: dict) -> bool:
    cpu = report["cpu_platform"]  # None when torch does not import
    return bool(cpu and cpu["redirects_apply"] and cpu["refusal"])


def _gpu_only_without_cuda(package: str) -> Callable[[dict], bool]:
    return lambda report: _version(report, package) is not None and not report["cuda"]["available"]


def _sharded_rdt_missing(report: dict) -> str:
    return " and ".join(sharded_rdt_needs.missing(lambda name: _version(report, name)))


@dataclasses.dataclass(frozen=True)
class Rule:
    """A known-bad combination: when ``applies(report)``, doctor prints ``message``.

    ``message`` names the problem and its fix on one line; ``{package}`` fields take installed
    versions, plus ``{python}``, ``{cuda}`` (torch's CUDA build) and ``{cpu_platform_refusal}``.
    """

    name: str
    applies: Callable[[dict], bool]
    message: str


RULES = (
    Rule(
        "python_too_old",
        lambda r: _major_minor(r["python"]["version"]) < (3, 10),
        "Python {python} is older than 3.10, the oldest rlmega supports; "
        "fix: recreate the virtualenv with Python 3.10 or newer (e.g. python3.11 -m venv .venv)",
    ),
    Rule(
        "torch_untested",
        lambda r: _outside(_version(r, "torch"), (2, 6), (2, 15)),
        "torch {torch} is outside the tested range >=2.6,<2.15; "
        f"fix: pip install torch==2.13.0 (CPU-only machines: {TORCH_CPU_INSTALL})",
    ),
    Rule(
        "megatron_core_untested",
        lambda r: _outside(_version(r, "megatron-core"), min(mcore_version.SUPPORTED),
                           (0, max(mcore_version.SUPPORTED)[1] + 1)),
        "megatron-core {megatron-core} is outside the supported range "
        f"{mcore_version.describe(mcore_version.SUPPORTED)}; fix: pip install '{mcore_version.PIP_RANGE}' "
        "(0.16.x on Python 3.11, 0.19.x on 3.12)",
    ),
    Rule(
        "cpu_platform_refuses_megatron_core",
        _cpu_platform_refuses,
        "without CUDA, rlmega's CPU platform will refuse to start: {cpu_platform_refusal}",
    ),
    Rule(
        "cuda_build_without_gpu",
        lambda r: bool(r["cuda"]["built_with"]) and not r["cuda"]["available"],
        "torch {torch} was built with CUDA {cuda} but sees no GPU; fix: check nvidia-smi, the driver "
        f"and CUDA_VISIBLE_DEVICES, or on a CPU-only machine: {TORCH_CPU_INSTALL}",
    ),
    Rule(
        "transformer_engine_without_cuda",
        _gpu_only_without_cuda("transformer-engine"),
        "transformer-engine {transformer-engine} is installed but torch sees no GPU, and it is GPU-only; "
        "fix: pip uninstall transformer-engine transformer-engine-torch, or make the GPU visible",
    ),
    Rule(
        "transformer_engine_untested",
        _transformer_engine_mismatched,
        "transformer-engine {transformer-engine} does not go with megatron-core {megatron-core}, which goes with "
        "{transformer_engine_range}; fix: pip install 'transformer-engine[pytorch]{transformer_engine_range}' "
        "(or rlmega's gpu extra), where a CUDA toolkit is (nvcc on the PATH or CUDA_HOME): its torch extension "
        "builds against it",
    ),
    Rule(
        "vllm_without_cuda",
        _gpu_only_without_cuda("vllm"),
        "vllm {vllm} is installed but torch sees no GPU, and vllm is GPU-only; "
        "fix: pip uninstall vllm, or make the GPU visible",
    ),
    Rule(
        "sglang_without_cuda",
        _gpu_only_without_cuda("sglang"),
        "sglang {sglang} is installed but torch sees no GPU, and sglang is GPU-only; "
        "fix: pip uninstall sglang, or make the GPU visible",
    ),
    Rule(
        "vllm_unsupported",
        lambda r: _outside(_version(r, "vllm"), (0, 33), (0, 35)),
        "vllm {vllm} is installed, but rlmega's vLLM adapter supports vllm>=0.33,<0.35 (VLLMEngine refuses "
        "to start); fix: pip install 'vllm>=0.33,<0.35'",
    ),
    Rule(
        "sglang_unsupported",
        lambda r: _version(r, "sglang") is not None
        and not (0, 5, 23) <= tuple(int(n) for n in re.findall(r"\d+", _version(r, "sglang"))[:3]) < (0, 5, 24),
        "sglang {sglang} is installed, but rlmega's SGLang adapter supports sglang>=0.5.23,<0.5.24 (SGLangEngine "
        "refuses to start); fix: pip install 'sglang>=0.5.23,<0.5.24'",
    ),
    Rule(
        "sharded_rdt_unavailable",
        lambda r: _version(r, "vllm") is not None and bool(_sharded_rdt_missing(r)),
        "vllm {vllm} is installed, but sync.transport=sharded_rdt also needs {sharded_rdt_missing}; "
        f"fix: {sharded_rdt_needs.INSTALL}",
    ),
    Rule(
        "unrelated_apex",
        lambda r: r["apex"]["installed"] and not r["apex"]["nvidia"],
        "the installed apex has neither apex.optimizers nor apex.normalization: it is the unrelated "
        "PyPI package 'apex', not NVIDIA apex; fix: pip uninstall apex, then build NVIDIA apex from "
        "source (https://github.com/NVIDIA/apex)",
    ),
)


def find_problems(report: dict) -> Dict[str, str]:
    """Rule name -> one-line message (problem and fix) for every rule that applies to ``report``."""
    fields = {name: entry["version"] or "?" for name, entry in report["packages"].items()}
    fields.update(
        python=report["python"]["version"],
        cuda=report["cuda"]["built_with"] or "?",
        cpu_platform_refusal=(report["cpu_platform"] or {}).get("refusal") or "?",
        sharded_rdt_missing=_sharded_rdt_missing(report) or "?",
        transformer_engine_range=transformer_engine_range(report) or "?",
    )
    return {rule.name: rule.message.format_map(fields) for rule in RULES if rule.applies(report)}


def missing_required(report: dict) -> List[str]:
    """One line per required package that is not installed, with the command that installs it."""
    return [
        f"{dep.name} is not installed; fix: {dep.install_command}"
        for dep in DEPENDENCIES
        if dep.required and _version(report, dep.name) is None
    ]


Row = Tuple[str, str, str]


def report_rows(report: dict) -> List[List[Row]]:
    """The table as sections of (item, value, note) rows: system, packages, accelerators."""
    python = report["python"]
    system = [
        ("rlmega", report["rlmega"], ""),
        ("python", python["version"], ""),
        ("python executable", python["executable"], ""),
        ("platform", report["platform"], ""),
    ]
    packages, absent_optional = [], []
    for name, entry in report["packages"].items():
        if entry["version"] is None and not entry["required"]:
            absent_optional.append(name)
            continue
        note = "" if entry["required"] else "optional"
        if name == "apex":
            note += ", NVIDIA" if report["apex"]["nvidia"] else ", not NVIDIA apex"
        packages.append((name, entry["version"] or "MISSING", note))
    if absent_optional:
        packages.append(("optional, not installed", ", ".join(absent_optional), ""))
    packages.append(("megatron-core + transformer-engine", *megatron_pair(report)))

    cuda = report["cuda"]
    if cuda["torch_error"]:
        accelerators = [("CUDA", "unknown", f"torch does not import: {cuda['torch_error']}")]
    else:
        build = f"torch built with CUDA {cuda['built_with']}" if cuda["built_with"] else "torch CPU build"
        accelerators = [("CUDA", "available" if cuda["available"] else "not available", build)]
    if cuda["available"]:
        accelerators.append(("GPUs", str(cuda["device_count"]), ", ".join(cuda["devices"])))
    if cuda["nccl"]:
        accelerators.append(("NCCL", cuda["nccl"], ""))
    accelerators.append(("distributed backend", report["distributed_backend"] or "unknown", ""))
    cpu = report["cpu_platform"]
    if cpu is not None:
        applies = "will be applied" if cpu["redirects_apply"] else "not needed (CUDA)"
        accelerators.append(("CPU platform redirects", applies, ""))
        checked = {True: "checked", False: "NOT checked", None: "missing"}[cpu["megatron_core_checked"]]
        releases = "checked releases: " + ", ".join(cpu["checked_megatron_core"])
        accelerators.append(("megatron-core on CPU", checked, releases))
    return [system, packages, accelerators]


def _summary(problems: Dict[str, str], missing: List[str]) -> str:
    if missing:
        return f"FAIL: {len(missing)} required package(s) missing"
    return f"OK: every required package is installed ({len(problems)} warning(s))"


def print_report(report: dict, problems: Dict[str, str], missing: List[str]) -> None:
    """Print the table, then one line per warning and per missing package, then a verdict."""
    sections = report_rows(report)
    lines = [("yellow", f"warning: {m}") for m in problems.values()]
    lines += [("red", f"missing: {m}") for m in missing]
    lines.append(("red" if missing else "green", _summary(problems, missing)))
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # rich may be among the missing packages; doctor must still speak
        for section in sections:
            for item, value, note in section:
                print(f"{item:<30} {value}" + (f"  ({note})" if note else ""))
            print()
        for _, line in lines:
            print(line)
        return
    table = Table(title="rlmega doctor", box=box.SIMPLE, show_header=False)
    table.add_column("item", no_wrap=True)
    table.add_column("value", overflow="fold")  # fold, not "…": versions and paths must stay whole
    for index, section in enumerate(sections):
        if index:
            table.add_section()
        for item, value, note in section:
            # Text, not markup strings: brackets in values stay literal.
            cell = Text(value)
            if note:
                cell.append(f"  ({note})", style="dim")
            table.add_row(Text(item), cell)
    console = Console(highlight=False)
    console.print(table)
    for style, line in lines:
        console.print(Text(line, style=style), soft_wrap=True)  # soft_wrap: one line per message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of a table"
    )


def run(args: argparse.Namespace) -> int:
    """Exit code 0 when every required package is installed (warnings allowed), else 1."""
    report = collect_report()
    problems = find_problems(report)
    missing = missing_required(report)
    if args.json:
        installed, verdict = megatron_pair(report)
        pair = {"installed": installed, "supported": verdict.startswith("supported"), "verdict": verdict}
        print(json.dumps({**report, "megatron_pair": pair, "problems": problems, "missing_required": missing},
                         indent=2))
    else:
        print_report(report, problems, missing)
    return 1 if missing else 0

"""Write the API snapshot that the vLLM and SGLang fakes validate every call against.

The fakes in ``tests/rollout/fakes`` stand in for the engines on CPU. So that they cannot drift from the
releases the adapters pin, this script reads the pinned wheel's own source (it never imports it: the
wheels are CUDA-only) and records what the adapters depend on: the signatures of every engine method
they call (via ``ast``), the fields of the request / output classes they build or read, the names of the
environment switches they set or clear, a few module constants, the checkpoint config keys the engine's
model code reads, the wheel's own pins on torch and transformers, and the format of the routed experts it
returns (``ROUTED_EXPERTS``: dtype, encoding, which layers and which tokens). The fakes bind every call to the
recorded signature (``fakes/api_snapshot.py``), so a dropped keyword, a renamed env switch or a changed
field fails a CPU test.

Regenerate after changing a pin in setup.py (the wheels download on any machine):

    pip download --no-deps vllm==0.33.0 sglang==0.5.23 -d /tmp/wheels
    python tests/rollout/engine_api_snapshot.py /tmp/wheels/vllm-0.33.0-*.whl /tmp/wheels/sglang-0.5.23-*.whl

A wheel path or an unpacked wheel directory both work. Output: ``tests/rollout/fakes/api/<name>.json``. The fakes
emulate the oldest supported release; each other release the extra admits has a snapshot beside it, compared with
it by tests/rollout/test_engine_pins.py:

    python tests/rollout/engine_api_snapshot.py /tmp/wheels/vllm-0.34.0-*.whl --suffix=-0.34
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from pathlib import Path

OUT_DIR = Path(__file__).parent / "fakes" / "api"

# What each adapter depends on: file -> {qualified name: "signature" | "fields"}.
TARGETS = {
    "vllm": {
        "vllm/entrypoints/llm.py": {
            "LLM.__init__": "signature", "LLM.generate": "signature", "LLM.sleep": "signature",
            "LLM.wake_up": "signature", "LLM.reset_prefix_cache": "signature", "LLM.collective_rpc": "signature",
        },
        "vllm/entrypoints/rl/offline.py": {
            "RLOfflineMixin.init_weight_transfer_engine": "signature",
            "RLOfflineMixin.start_weight_update": "signature",
            "RLOfflineMixin.update_weights": "signature",
            "RLOfflineMixin.finish_weight_update": "signature",
            "RLOfflineMixin.shutdown_weight_transfer_engine": "signature",
            "RLOfflineMixin.get_weight_version": "signature",
        },
        "vllm/sampling_params.py": {"SamplingParams": "fields"},
        "vllm/outputs.py": {"CompletionOutput": "fields", "RequestOutput.__init__": "signature"},
        "vllm/logprobs.py": {"Logprob": "fields"},
        "vllm/distributed/weight_transfer/ipc_engine.py": {
            "IPCWeightTransferInitInfo": "fields", "IPCWeightTransferUpdateInfo": "fields"},
        "vllm/distributed/weight_transfer/nccl_engine.py": {"NCCLWeightTransferUpdateInfo": "fields"},
        "vllm/distributed/weight_transfer/nccl_common.py": {"NCCLWeightTransferInitInfo": "fields"},
        "vllm/config/weight_transfer.py": {"WeightTransferConfig": "fields"},
        # rlmega.rollout.vllm_weight_source: the trainer's weights as the resharding backends read them.
        "vllm/distributed/weight_transfer/base.py": {
            "ParamMeta": "fields", "Shard": "fields", "Replicate": "fields", "WeightSource.owned_names": "signature",
            "WeightSource.iter_local": "signature", "WeightSource.iter_full": "signature",
            "TrainerInitInfo": "fields", "TrainerWeightTransferEngine.send_weights": "signature"},
        # rlmega.sync.vllm_sharded: the sharded_rdt backend driven from every trainer rank.
        "vllm/distributed/weight_transfer/factory.py": {"WeightTransferTrainerFactory.trainer_init": "signature"},
        "vllm/distributed/weight_transfer/sharded_rdt_trainer.py": {
            "ShardedRDTTrainerInitInfo": "fields", "ShardedRDTTrainerWeightTransferEngine.send_weights": "signature"},
        "vllm/distributed/weight_transfer/sharded_rdt_engine.py": {
            "ShardedRDTWeightTransferInitInfo": "fields", "ShardedRDTWeightTransferUpdateInfo": "fields"},
        "vllm/engine/arg_utils.py": {"EngineArgs": "fields"},
        # rlmega.rollout.vllm_lora: adapters loaded from a PEFT directory, and every request naming the current one.
        "vllm/lora/request.py": {"LoRARequest": "fields"},
        "vllm/v1/engine/llm_engine.py": {
            "LLMEngine.add_lora": "signature", "LLMEngine.remove_lora": "signature",
            "LLMEngine.list_loras": "signature"},
    },
    "sglang": {
        "sglang/srt/entrypoints/engine.py": {
            f"Engine.{name}": "signature" for name in (
                "generate", "update_weights_from_tensor", "init_weights_update_group",
                "update_weights_from_distributed", "destroy_weights_update_group", "begin_weight_update",
                "end_weight_update", "flush_cache", "release_memory_occupation", "resume_memory_occupation",
                "shutdown", "load_lora_adapter", "unload_lora_adapter")
        },
        "sglang/srt/managers/tokenizer_manager.py": {"TokenizerManager.abort_request": "signature"},
        "sglang/srt/sampling/sampling_params.py": {"SamplingParams": "fields"},
        # rlmega.rollout.lora_serving: adapters loaded from a PEFT directory by name, their result, and requests
        # naming the current one (Engine.generate's lora_path).
        "sglang/srt/managers/io_struct.py": {"LoRAUpdateOutput": "fields"},
    },
}

# Field sets assembled from several classes: recorded name -> (directory, what the classes' fields are).
# SGLang 0.5.23 builds ``ServerArgs`` from per-topic namespaces in arg_groups/fields/*.py.
FIELD_UNIONS = {"sglang": {"ServerArgs": "sglang/srt/arg_groups/fields/"}}

# Module-level list / tuple constants the adapters or the GPU fixtures rely on.
CONSTANTS = {
    "vllm": {"vllm/config/model.py": ["LogprobsMode"], "vllm/v1/engine/__init__.py": ["PauseMode"],
             "vllm/config/lora.py": ["MaxLoRARanks"]},
    "sglang": {"sglang/srt/arg_groups/choices.py": ["DETERMINISTIC_ATTENTION_BACKEND_CHOICES"],
               "sglang/srt/utils/common.py": ["SUPPORTED_LORA_TARGET_MODULES"]},
}

# Environment switches: every name matching the pattern, in these files.
ENV_SOURCES = {
    "vllm": (["vllm/envs.py"], r"\bVLLM_[A-Z0-9_]+\b"),
    "sglang": (["sglang/srt/environ.py", "sglang/srt/layers/sampler.py"], r"\b(?:SGLANG_)?[A-Z0-9_]*LOGPROB[A-Z0-9_]*\b"),
}

# Checkpoint config keys the engine's model code reads for the RoPE base, per model file.
ROPE_KEYS = ("rope_theta", "rope_parameters", "rope_scaling")
MODEL_FILES = {
    "vllm": {"llama": "vllm/model_executor/models/llama.py", "qwen3_moe": "vllm/model_executor/models/qwen3_moe.py"},
    "sglang": {"llama": "sglang/srt/models/llama.py", "qwen3_moe": "sglang/srt/models/qwen3_moe.py"},
}

PINNED = ("torch", "transformers")

# Where each release decides the format of the routed experts it returns: what -> (file, qualified function).
ROUTED_EXPERTS = {
    "vllm": {
        # self.output_dtype_name = "uint8" if num_experts <= 256 else "uint16"
        "dtype": ("vllm/model_executor/layers/fused_moe/routed_experts_capturer.py",
                  "RoutedExpertsCapturer.__init__"),
        # num_layers = model_config.get_total_num_hidden_layers()
        "layers": ("vllm/model_executor/layers/fused_moe/routed_experts_capturer.py", "_get_routed_experts_shape"),
        # token_end = request.num_tokens - 1
        "rows_end": ("vllm/distributed/aux_output_connector/connector.py", "AuxOutputSchedulerConnector.take_output"),
    },
    "sglang": {
        # np.frombuffer(pybase64.b64decode(...), dtype=np.int32)
        "dtype": ("sglang/srt/state_capturer/routed_experts.py", "extract_routed_experts_from_meta_info"),
        # num_layers = model_config.hf_text_config.num_hidden_layers; topk_size = ....num_experts_per_tok
        "layers": ("sglang/srt/state_capturer/routed_experts.py", "RoutedExpertsCapturer.__init__"),
        # req_to_token[req_pool_idx][start_len : seqlen - 1]
        "rows_end": ("sglang/srt/state_capturer/base.py", "BaseTopkCapturer.get_topk"),
    },
}


class Source:
    """A wheel file or an unpacked wheel directory."""

    def __init__(self, path: Path):
        self.path = path
        self._zip = zipfile.ZipFile(path) if path.is_file() else None

    def read(self, name: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(name).decode()
            except KeyError:
                return None
        file = self.path / name
        return file.read_text() if file.exists() else None

    def names(self) -> list[str]:
        if self._zip is not None:
            return self._zip.namelist()
        return [str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file()]


def _default(node: ast.expr | None):
    if node is None:
        return None
    try:
        return repr(ast.literal_eval(node))
    except ValueError:
        return ast.unparse(node)


def signature_of(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[list]:
    """``[name, kind, default or None]`` per parameter; kind as in ``inspect.Parameter``; ``self`` dropped."""
    args = function.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = []
    for index, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "POSITIONAL_ONLY" if index < len(args.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        params.append([arg.arg, kind, _default(default), default is not None])
    if args.vararg:
        params.append([args.vararg.arg, "VAR_POSITIONAL", None, False])
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        params.append([arg.arg, "KEYWORD_ONLY", _default(default), default is not None])
    if args.kwarg:
        params.append([args.kwarg.arg, "VAR_KEYWORD", None, False])
    if params and params[0][0] in ("self", "cls"):
        params = params[1:]
    return params


def fields_of(cls: ast.ClassDef) -> list[list]:
    """``[name, annotation, default or None, has default]`` of each annotated class attribute, in order."""
    fields = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation = ast.unparse(node.annotation)
            if annotation.startswith("ClassVar"):
                continue
            fields.append([node.target.id, annotation, _default(node.value), node.value is not None])
    return fields


def _find(tree: ast.Module, qualified: str):
    scope: list[ast.stmt] = tree.body
    found = None
    for part in qualified.split("."):
        found = next((n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.name == part), None)
        if found is None:
            return None
        scope = found.body
    return found


def _constant(tree: ast.Module, name: str):
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            value = node.value
            if isinstance(value, ast.Subscript):  # Literal["a", "b"]
                value = value.slice
            return list(ast.literal_eval(value))
    return None


def _requirements(source: Source, package: str) -> dict:
    metadata_name = next(n for n in source.names() if n.endswith(".dist-info/METADATA"))
    metadata = source.read(metadata_name)
    version = re.search(r"^Version: (.+)$", metadata, re.M)[1].strip()
    pins = {}
    for line in metadata.splitlines():
        match = re.match(r"Requires-Dist: ([A-Za-z0-9_.-]+)(.*)$", line)
        if match and match[1].lower() in PINNED and "extra ==" not in match[2]:
            pins[match[1].lower()] = match[2].split(";")[0].strip()
    python = re.search(r"^Requires-Python: (.+)$", metadata, re.M)
    return {"version": version, "requires_python": python[1].strip() if python else None, "requires": pins}


def _assigned(function, name: str) -> ast.expr:
    """The value assigned to ``name`` (a local or ``self.<name>``) in ``function``."""
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Name) and target.id == name) or \
                        (isinstance(target, ast.Attribute) and target.attr == name):
                    return node.value
    raise SystemExit(f"{function.name} assigns no {name}")


def _minus_constant(node: ast.expr) -> int:
    """``x - 1`` -> -1."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and isinstance(node.right, ast.Constant)):
        raise SystemExit(f"expected `<tokens> - <constant>`, found {ast.unparse(node)}")
    return -node.right.value


def routed_experts_format(package: str, source: Source) -> dict:
    """What the release returns as routed experts, read from the functions ``ROUTED_EXPERTS`` names."""
    def function(what):
        file, qualified = ROUTED_EXPERTS[package][what]
        node = _find(ast.parse(source.read(file)), qualified)
        if node is None:
            raise SystemExit(f"{qualified} is not in {file} of {source.path}")
        return node

    if package == "vllm":
        choice = _assigned(function("dtype"), "output_dtype_name")  # IfExp: small if num_experts <= N else large
        layers = _assigned(function("layers"), "num_layers")
        return {"encoding": "numpy", "dtype_small": choice.body.value,
                "max_experts_small": choice.test.comparators[0].value, "dtype_large": choice.orelse.value,
                "layers_from": layers.func.attr,
                "rows_end_offset": _minus_constant(_assigned(function("rows_end"), "token_end"))}
    decode = function("dtype")
    dtype = next(k.value.attr for n in ast.walk(decode) if isinstance(n, ast.Call)
                 for k in n.keywords if k.arg == "dtype")
    encoding = "base64" if "b64decode" in ast.unparse(decode) else "unknown"
    init = function("layers")
    uppers = [n.upper for n in ast.walk(function("rows_end")) if isinstance(n, ast.Slice) and n.upper is not None]
    return {"encoding": encoding, "dtype": dtype, "layers_from": _assigned(init, "num_layers").attr,
            "topk_from": _assigned(init, "topk_size").attr, "rows_end_offset": _minus_constant(uppers[0])}


def snapshot(package: str, source: Source) -> dict:
    result = {"package": package, **_requirements(source, package), "signatures": {}, "fields": {},
              "constants": {}, "env": [], "rope_config_keys": {}}
    for file, targets in TARGETS[package].items():
        text = source.read(file)
        if text is None:
            raise SystemExit(f"{file} is not in {source.path}")
        tree = ast.parse(text)
        for qualified, what in targets.items():
            node = _find(tree, qualified)
            if node is None:
                raise SystemExit(f"{qualified} is not in {file} of {source.path}")
            entry = {"file": file, "params" if what == "signature" else "fields":
                     signature_of(node) if what == "signature" else fields_of(node)}
            result["signatures" if what == "signature" else "fields"][qualified] = entry
    for recorded, directory in FIELD_UNIONS.get(package, {}).items():
        fields = []
        for name in sorted(n for n in source.names() if n.startswith(directory) and n.endswith(".py")):
            for node in ast.walk(ast.parse(source.read(name))):
                if isinstance(node, ast.ClassDef):
                    fields += [[f[0], None, None, f[3]] for f in fields_of(node)]
        result["fields"][recorded] = {"file": directory, "fields": fields}
    for file, names in CONSTANTS[package].items():
        tree = ast.parse(source.read(file))
        for name in names:
            result["constants"][name] = _constant(tree, name)
    files, pattern = ENV_SOURCES[package]
    result["env"] = sorted({name for file in files for name in re.findall(pattern, source.read(file) or "")})
    for model, file in MODEL_FILES[package].items():
        text = source.read(file) or ""
        result["rope_config_keys"][model] = [key for key in ROPE_KEYS if key in text]
    result["routed_experts"] = routed_experts_format(package, source)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="vllm / sglang wheels or unpacked wheel directories")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--suffix", default="", help="appended to the file name: the fakes read <package>.json, the "
                        "release they emulate; another supported release goes beside it, e.g. --suffix=-0.34")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.sources:
        package = "sglang" if "sglang" in path.name else "vllm"
        data = snapshot(package, Source(path))
        out = args.out / f"{package}{args.suffix}.json"
        out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"{out}: {package} {data['version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

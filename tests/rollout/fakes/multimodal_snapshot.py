"""Write the multi-modal part of the API snapshot (``api/<package>_multimodal.json``) from the pinned wheels.

``tests/rollout/engine_api_snapshot.py`` records the engine calls; this records what the fakes need to check
how images travel with a token-id prompt to a Qwen2.5-VL model, read (never imported) from the wheels' source:

- vLLM 0.33: the keys of a ``TokensPrompt`` (vllm/inputs/llm.py, its own and ``_PromptOptions``'), the
  modalities of ``multi_modal_data`` (``MultiModalDataBuiltins``), the fields a dict image item must carry
  (``Qwen2VLMultiModalDataParser.embedding_fields`` in vllm/model_executor/models/qwen2_vl.py: embeddings, never
  pixel values), the target of the image prompt replacement (``Qwen2_5_VLMultiModalProcessor._get_prompt_updates``
  in qwen2_5_vl.py: one pad token per image, which vLLM expands itself) and the request-side size kwargs
  (``Qwen2VLProcessingInfo._complete_mm_processor_size_aliases``).
- SGLang 0.5.23: the names of the pre-processed input formats (``MultimodalInputFormat`` in
  sglang/srt/multimodal/modality.py, the strings ``_get_preprocessed_input_format`` accepts in
  multimodal/processors/base_processor.py) and the processor-output keys it reads as image data
  (``ATTR_NAME_TO_MODALITY`` entries for ``Modality.IMAGE``; ``FEATURE_NAMES``).

Regenerate with the same wheels as engine_api_snapshot.py:

    python -m tests.rollout.fakes.multimodal_snapshot /tmp/wheels/vllm-0.33.0-*.whl /tmp/wheels/sglang-0.5.23-*.whl
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

from tests.rollout.engine_api_snapshot import OUT_DIR, Source, _find, _requirements, fields_of


def _tree(source: Source, file: str) -> ast.Module:
    text = source.read(file)
    if text is None:
        raise SystemExit(f"{file} is not in {source.path}")
    return ast.parse(text)


def _node(source: Source, file: str, qualified: str):
    node = _find(_tree(source, file), qualified)
    if node is None:
        raise SystemExit(f"{qualified} is not in {file} of {source.path}")
    return node


def _class_value(cls: ast.ClassDef, name: str):
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"{cls.name} assigns no {name}")


def _keyword(function, call_name: str, keyword: str) -> str:
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == call_name:
            for kw in node.keywords:
                if kw.arg == keyword:
                    return ast.unparse(kw.value)
    raise SystemExit(f"{function.name} calls no {call_name}({keyword}=...)")


def vllm_multimodal(source: Source) -> dict:
    inputs = "vllm/inputs/llm.py"
    prompt_keys = [f[0] for cls in ("_PromptOptions", "TokensPrompt") for f in fields_of(_node(source, inputs, cls))]
    modalities = [f[0] for f in fields_of(_node(source, inputs, "MultiModalDataBuiltins"))]
    parser = _node(source, "vllm/model_executor/models/qwen2_vl.py", "Qwen2VLMultiModalDataParser")
    aliases = _node(source, "vllm/model_executor/models/qwen2_vl.py",
                    "Qwen2VLProcessingInfo._complete_mm_processor_size_aliases")
    size_kwargs = sorted({element.elts[1].value for element in ast.walk(aliases)
                          if isinstance(element, ast.Tuple) and len(element.elts) == 2
                          and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in element.elts)
                          and element.elts[0].value.endswith("_edge")})  # ("shortest_edge", "min_pixels"), ...
    updates = _node(source, "vllm/model_executor/models/qwen2_5_vl.py",
                    "Qwen2_5_VLMultiModalProcessor._get_prompt_updates")
    return {"tokens_prompt_keys": prompt_keys, "modalities": modalities,
            "qwen2_5_vl": {"dict_image_fields": _class_value(parser, "embedding_fields")["image"],
                           "image_replacement_target": _keyword(updates, "PromptReplacement", "target"),
                           "size_kwargs": size_kwargs}}


def sglang_multimodal(source: Source) -> dict:
    formats = _node(source, "sglang/srt/multimodal/modality.py", "MultimodalInputFormat")
    members = [t.id for node in formats.body if isinstance(node, ast.Assign) for t in node.targets]
    base = "sglang/srt/multimodal/processors/base_processor.py"
    # the lower-case spellings in its `data_format in (MultimodalInputFormat.X.name, "x")` tests
    accepted = sorted({e.value for node in ast.walk(_node(source, base, "BaseMultimodalProcessor"
                                                          "._get_preprocessed_input_format"))
                       if isinstance(node, ast.Tuple) for e in node.elts
                       if isinstance(e, ast.Constant) and isinstance(e.value, str)})
    init = _node(source, base, "BaseMultimodalProcessor.__init__")
    image_keys, feature_names = [], []
    for node in ast.walk(init):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            if node.targets[0].attr == "ATTR_NAME_TO_MODALITY":
                image_keys = [k.value for k, v in zip(node.value.keys, node.value.values)
                              if ast.unparse(v) == "Modality.IMAGE"]
            elif node.targets[0].attr == "FEATURE_NAMES":
                feature_names = ast.literal_eval(node.value)
    return {"input_formats": members, "format_strings": accepted, "image_keys": image_keys,
            "feature_names": feature_names}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="vllm / sglang wheels or unpacked wheel directories")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    for path in args.sources:
        package = "sglang" if "sglang" in path.name else "vllm"
        source = Source(path)
        data = {"package": package, "version": _requirements(source, package)["version"],
                **(sglang_multimodal(source) if package == "sglang" else vllm_multimodal(source))}
        out = args.out / f"{package}_multimodal.json"
        out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"{out}: {package} {data['version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

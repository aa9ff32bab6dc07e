"""mcore-to-hf --fp8: linear weights as blockwise FP8 with their scales, bit-identical to the reference
quantization of the live model's export; config.json says so in the engines' words; read back dequantized."""

import json

import pytest
import torch
from safetensors.torch import load_file

from converter_checkpoints import save_checkpoint
from converters.cli import main
from rlmega.bridge.fp8 import FP8_DTYPE, is_quantized, quantize_blockwise, scale_name
from rlmega.rollout.hf_engine import HFEngine


def read_export(directory):
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def moe_checkpoint(hf_models, tmp_path_factory):
    return save_checkpoint(hf_models["qwen3-moe"], tmp_path_factory.mktemp("ckpt-fp8"), dict(tp=2, ep=2, world_size=2))


def test_fp8_export_is_the_reference_quantization(moe_checkpoint, hf_models, tmp_path, capsys):
    root, live = moe_checkpoint
    output = tmp_path / "hf-fp8"
    assert main(["mcore-to-hf", str(root), str(output), "--hf-base", str(hf_models["qwen3-moe"]), "--fp8",
                 "--quiet"]) == 0
    exported = read_export(output)
    quantized = [name for name, tensor in live.items() if is_quantized(name, tensor.shape)]
    assert any(".experts." in name for name in quantized) and any("self_attn" in name for name in quantized)
    assert sorted(exported) == sorted(list(live) + [scale_name(name) for name in quantized])
    for name, tensor in live.items():
        if name in quantized:
            expected, scales = quantize_blockwise(tensor)
            assert exported[name].dtype == FP8_DTYPE, name
            assert torch.equal(exported[name].view(torch.uint8), expected.view(torch.uint8)), name
            assert torch.equal(exported[scale_name(name)], scales), name
        else:
            assert torch.equal(exported[name], tensor), name
    config = json.loads((output / "config.json").read_text())
    routers = [name.removesuffix(".weight") for name in live if name.endswith(".mlp.gate.weight")]
    assert len(routers) == config["num_hidden_layers"]
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": sorted(["lm_head"] + routers)}
    assert config["dtype"] == str(live["model.embed_tokens.weight"].dtype).removeprefix("torch.")

    # Read back: the hf engine dequantizes the checkpoint's FP8 weights into what an FP8 engine started from the
    # plain export serves (transformers' own FP8 loader needs accelerate, and a GPU to keep the weights in FP8).
    plain = tmp_path / "hf"
    assert main(["mcore-to-hf", str(root), str(plain), "--hf-base", str(hf_models["qwen3-moe"]), "--quiet"]) == 0
    served = HFEngine(output).model.state_dict()
    reference = HFEngine(plain, weight_dtype="fp8").model.state_dict()
    for name, tensor in reference.items():
        torch.testing.assert_close(served[name], tensor, atol=0, rtol=0, msg=name)

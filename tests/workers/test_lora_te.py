"""LoRA under the transformer-engine layer spec, on CPU through a stand-in for ``TELayerNormColumnParallelLinear``
(TE's ``LayerNormLinear``: the input norm fused into ``linear_qkv`` / ``linear_fc1``): the adapter reads the normalised
input the layer returns on request (``return_layernorm_output``), so the layer computes ``norm(x) @ (W + s B A)^T``
and its input gradient is that of the merged layer. The stand-in's constructor, attributes and return values are
checked against transformer-engine 2.20's source (when its wheel is at hand) and Megatron-Core's wrapper (always).
The real TE spec is checked on a GPU in tests/gpu/test_lora_te_gpu.py."""

import ast
import glob
import importlib.util
import os
import zipfile
from pathlib import Path

import pytest
import torch

from rlmega.models import lora

RANK, ALPHA = 4, 8.0
HIDDEN, OUT = 16, 24
TE_SOURCE = "transformer_engine/pytorch/module/layernorm_linear.py"


@pytest.fixture
def single_rank():
    """A process group of one rank over an in-memory store, for Megatron's tensor-parallel mappings."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class LayerNormLinear(torch.nn.Module):
    """transformer-engine's ``LayerNormLinear`` as far as LoRA's path goes, on one TP rank: RMSNorm, then the
    linear layer; ``forward`` returns ``out``, ``(out, bias)``, ``(out, ln_out)`` or ``(out, bias, ln_out)``."""

    def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False, tp_group=None, tp_size=1,
                 bias=True, normalization="RMSNorm", return_bias=False, parallel_mode=None,
                 return_layernorm_output=False, return_layernorm_output_gathered=False):
        super().__init__()
        assert normalization == "RMSNorm" and tp_size == 1
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        self.tp_group, self.tp_size, self.parallel_mode = tp_group, tp_size, parallel_mode
        self.sequence_parallel = (tp_size > 1) and sequence_parallel
        self.return_bias = return_bias
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered if return_layernorm_output else False
        generator = torch.Generator().manual_seed(out_features)
        self.layer_norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(in_features, generator=generator))
        self.weight = torch.nn.Parameter(0.2 * torch.randn(out_features, in_features, generator=generator))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(out_features, generator=generator)) if bias else None

    def forward(self, inp, is_first_microbatch=None):
        variance = inp.pow(2).mean(-1, keepdim=True)
        ln_out = inp * torch.rsqrt(variance + self.eps) * self.layer_norm_weight
        out = ln_out @ self.weight.t()
        if self.bias is not None and not self.return_bias:
            out = out + self.bias
        if self.return_bias:
            if self.return_layernorm_output:
                return out, self.bias, ln_out
            return out, self.bias
        if self.return_layernorm_output:
            return out, ln_out
        return out


class _Config:
    gated_linear_unit = False


class TELayerNormColumnParallelLinear(LayerNormLinear):
    """Megatron-Core's wrapper around it: a column-parallel layer that always returns ``(out, bias)``."""

    def __init__(self, input_size, output_size, *, skip_bias_add, tp_group):
        self.config = _Config()
        self.te_return_bias = skip_bias_add
        super().__init__(input_size, output_size, return_bias=self.te_return_bias, parallel_mode="column",
                         tp_group=tp_group, return_layernorm_output=False)
        self._tp_group = self.tp_group
        self.weight.partition_dim, self.weight.tensor_model_parallel = 0, True

    def forward(self, x):
        out = super().forward(x, is_first_microbatch=None)
        if self.te_return_bias:
            return out
        return out, None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}


def _model(tp_group):
    """A one-layer stand-in of a GPT model with the TE spec's fused norm + linear_qkv and linear_fc1."""
    layer = torch.nn.Module()
    layer.layer_number = 1
    layer.self_attention = torch.nn.Module()
    layer.self_attention.linear_qkv = TELayerNormColumnParallelLinear(HIDDEN, OUT, skip_bias_add=False, tp_group=tp_group)
    layer.mlp = torch.nn.Module()
    layer.mlp.linear_fc1 = TELayerNormColumnParallelLinear(HIDDEN, OUT, skip_bias_add=True, tp_group=tp_group)
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([layer])
    return model


def _merged_reference(module, x):
    """The layer with its adapter merged into the weight, without the adapter's path: ``(out, bias)``."""
    weight = module.adapter.effective_weight(module.weight)
    base = LayerNormLinear(HIDDEN, OUT, return_bias=module.te_return_bias)
    base.load_state_dict({"layer_norm_weight": module.layer_norm_weight, "weight": weight, "bias": module.bias})
    out = base(x)
    return out if module.te_return_bias else (out, None)


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_fused_norm_layers_adapt_the_normalised_input(single_rank, dropout):
    model = _model(single_rank)
    lora.attach(model, lora.LoraConfig(rank=RANK, alpha=ALPHA, dropout=dropout,
                                       target_modules=["linear_qkv", "linear_fc1"]))
    layer = model.decoder.layers[0]
    x = torch.randn(5, 2, HIDDEN, generator=torch.Generator().manual_seed(1))
    for module in (layer.self_attention.linear_qkv, layer.mlp.linear_fc1):
        assert module.return_layernorm_output and not module.return_layernorm_output_gathered
        with torch.no_grad():
            module.adapter.lora_b.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
            want, want_bias = _merged_reference(module, x)
            got, bias = module(x)  # a log-prob pass: never dropped
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            assert (bias is None) == (want_bias is None) and (bias is None or torch.equal(bias, want_bias))
            with lora.adapters_disabled([model]):
                base_out = module(x)[0]
        assert not torch.allclose(base_out, got, atol=1e-3)
        if dropout:  # a training pass drops elements of the adapter's input
            assert not torch.allclose(module(x.clone().requires_grad_())[0], want, atol=1e-3)
            continue
        # The input gradient flows through the adapter's path into the norm as through the merged layer's.
        x_adapted, x_merged = x.clone().requires_grad_(), x.clone().requires_grad_()
        module(x_adapted)[0].square().sum().backward()
        _merged_reference(module, x_merged)[0].square().sum().backward()
        torch.testing.assert_close(x_adapted.grad, x_merged.grad, atol=1e-5, rtol=0)
        assert module.adapter.lora_b.grad is not None and module.weight.grad is None  # the base is frozen


def _te_wheel() -> str | None:
    found = [os.environ.get("RLMEGA_TE_WHEEL", "")] + sorted(glob.glob("/tmp/te220/transformer_engine-2.20*.whl"))
    return next((path for path in found if path and Path(path).is_file()), None)


def _class(source: str, name: str) -> ast.ClassDef:
    return next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef) and node.name == name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == name)


def _self_attributes(function: ast.FunctionDef) -> set[str]:
    return {target.attr for node in ast.walk(function) if isinstance(node, (ast.Assign, ast.AugAssign))
            for target in getattr(node, "targets", [getattr(node, "target", None)])
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"}


def _returns(function: ast.FunctionDef) -> set[str]:
    return {ast.unparse(node.value) for node in ast.walk(function) if isinstance(node, ast.Return) and node.value}


def test_stand_in_matches_transformer_engine_2_20():
    wheel = _te_wheel()
    if wheel is None:
        pytest.skip("transformer-engine 2.20's wheel is not here (pip download --no-deps transformer_engine==2.20.2 "
                    "-d /tmp/te220, or RLMEGA_TE_WHEEL=path): the stand-in's names are not cross-checked")
    with zipfile.ZipFile(wheel) as archive:
        layer = _class(archive.read(TE_SOURCE).decode(), "LayerNormLinear")
    init, forward = _method(layer, "__init__"), _method(layer, "forward")
    ours = _method(_class(Path(__file__).read_text(), "LayerNormLinear"), "__init__")
    assert {arg.arg for arg in ours.args.args} <= {arg.arg for arg in init.args.args}
    assert {"in_features", "out_features", "return_bias", "return_layernorm_output",
            "return_layernorm_output_gathered", "sequence_parallel", "tp_size", "parallel_mode"} <= _self_attributes(init)
    assert [arg.arg for arg in forward.args.args[:3]] == ["self", "inp", "is_first_microbatch"]
    returns = _returns(forward)
    assert "(out, ln_out)" in returns and "out" in returns
    assert any(text.startswith("(out, cast_if_needed(bias_tensor") and text.endswith(", ln_out)") for text in returns)
    assert "layer_norm_weight" in ast.unparse(init)


def test_stand_in_matches_megatron_cores_wrapper():
    source = Path(importlib.util.find_spec("megatron.core").origin).parent / "extensions" / "transformer_engine.py"
    wrapper = _class(source.read_text(), "TELayerNormColumnParallelLinear")
    assert {"te_return_bias", "_tp_group"} <= _self_attributes(_method(wrapper, "__init__"))
    assert _returns(_method(wrapper, "forward")) == {"out", "(out, None)"}
    assert [base.attr for base in wrapper.bases] == ["LayerNormLinear"]

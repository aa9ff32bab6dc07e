"""Megatron-Core without transformer-engine outside the CPU platform (a GPU machine without the gpu extra):
``rlmega.parallel.mcore_without_te`` must make the MoE router's gating and MLA's check work by themselves.
Each test runs in a fresh interpreter, where the CPU platform (which also applies them) was never enabled."""

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                                reason="transformer-engine is installed: Megatron defines the names itself")

SCRIPT = """
import torch
from rlmega.parallel import cpu_platform, mcore_without_te
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.moe.moe_utils import router_gating_linear

assert not cpu_platform.is_enabled()
assert mcore_without_te.apply() and mcore_without_te.apply()  # idempotent
generator = torch.Generator().manual_seed(0)
inp, weight = torch.randn(5, 8, generator=generator), torch.randn(4, 8, generator=generator)
inp.requires_grad_(True)
logits = router_gating_linear(inp, weight, None, torch.float32)
torch.testing.assert_close(logits, inp @ weight.t(), rtol=0, atol=1e-6)
logits.sum().backward()
torch.testing.assert_close(inp.grad, weight.sum(0).expand(5, 8), rtol=0, atol=1e-6)
print(multi_latent_attention.HAVE_TE)
# The CPU-offloaded optimizer's config: precision-aware without transformer-engine's version to compare.
from megatron.core.optimizer import OptimizerConfig
config = OptimizerConfig(optimizer="adam", bf16=True, use_distributed_optimizer=True, optimizer_cpu_offload=True,
                         use_precision_aware_optimizer=True)
print(config.use_precision_aware_optimizer_no_fp8_or_ds_fp8, config.store_param_remainders)
"""


def test_router_gating_mla_and_the_offloaded_optimizer_config_work_without_transformer_engine():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True", "False"]

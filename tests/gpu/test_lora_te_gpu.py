"""LoRA under the real transformer-engine layer spec: the input norms fused into ``linear_qkv`` / ``linear_fc1``
(``TELayerNormColumnParallelLinear``) and TE's row-parallel ``linear_proj`` / ``linear_fc2``. With random non-zero B the
actor's fp32 log-probs equal the HF model's with merged weights (1e-3, TF32 off), and an update trains the adapters
with dropout on. Needs CUDA and transformer-engine (`pip install -e .[gpu]`); the CPU twin is
tests/workers/test_lora_te.py (a stand-in of TE's layer) with tests/workers/test_lora.py (the local spec)."""

import zlib

import pytest
import torch

from rlmega.bridge.mapping import RuleBook, to_hf
from rlmega.bridge.params import geometry_of
from rlmega.models import lora, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import free_port
from rlmega.workers.config import OptimizerConfig, PolicyLossConfig, WorkerConfig
from rlmega.workers.worker import MegatronWorker

from .test_worker_gpu import _batch, _hf_logprobs

pytestmark = pytest.mark.gpu

RANK, ALPHA = 4, 8.0


@pytest.fixture
def single_rank(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("transformer_engine")
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    initialize(ParallelLayout())
    yield ParallelLayout()
    destroy(including_default_group=True)


def _whole_b(name: str, rows: int) -> torch.Tensor:
    return 0.05 * torch.randn(rows, RANK, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1))


def _merged_dir(worker, hf_dir, target):
    """The HF model with every adapter of ``worker`` merged (its A, the B ``_whole_b`` gives), saved in ``target``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    book, geometry, state = RuleBook(worker.spec.architecture), geometry_of(worker.spec), model.state_dict()
    for name, adapter in lora.adapters(worker.chunks):  # one rank: every adapter is whole
        delta = ALPHA / RANK * adapter.lora_b.detach().float().cpu() @ adapter.lora_a.detach().float().cpu()
        _, _, number, rest = name.split(".", 3)
        rule, names = book.resolve(f"decoder.layers.{int(number) - 1}.{rest}.weight")
        for hf_name, part in to_hf(rule, delta, names, geometry, 1).items():
            state[hf_name] += part
    model.load_state_dict(state)
    model.save_pretrained(target)
    return target


def test_lora_under_the_te_spec_equals_the_merged_model(single_rank, gpu_llama_dir, tmp_path):
    config = WorkerConfig(role="actor", dtype="fp32", lora=lora.LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.1),
                          optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, lr_schedule="constant"),
                          policy_loss=PolicyLossConfig(name="ppo"))
    worker = MegatronWorker(model_spec_from_hf(gpu_llama_dir), single_rank, config, hf_dir=gpu_llama_dir)
    owners = {type(module).__name__ for chunk in worker.chunks for module in chunk.modules() if hasattr(module, "adapter")}
    assert "TELayerNormColumnParallelLinear" in owners and "TERowParallelLinear" in owners, owners
    with torch.no_grad():
        for name, adapter in lora.adapters(worker.chunks):
            adapter.lora_b.copy_(_whole_b(name, adapter.lora_b.shape[0]))
    batch = _batch()
    logprobs, _ = worker.compute_logprobs(batch)
    again, _ = worker.compute_logprobs(batch)  # dropout never acts in log-prob passes
    expected = _hf_logprobs(_merged_dir(worker, gpu_llama_dir, tmp_path / "merged"), batch)
    differences = torch.cat([(got.cpu() - want).abs() for got, want in zip(logprobs, expected)])
    assert differences.max() <= 1e-3, differences.max()
    assert all(torch.equal(first, second) for first, second in zip(logprobs, again))
    generator = torch.Generator().manual_seed(1)
    advantages = [torch.randn(n, generator=generator) for n in batch.response_lengths]
    before = {name: adapter.lora_b.detach().clone() for name, adapter in lora.adapters(worker.chunks)}
    metrics = worker.update(batch.with_fields(old_logp=logprobs, advantages=advantages))
    assert metrics["actor/grad_norm"] > 0
    moved = [name for name, adapter in lora.adapters(worker.chunks) if not torch.equal(adapter.lora_b, before[name])]
    assert len(moved) == len(before)  # every adapter, the fused-norm layers' included, got a gradient

"""The Megatron worker on one CUDA device: bf16 and fp32 log-probs against HF, and packed (THD
with transformer-engine) against padded updates. Needs CUDA (tests/gpu/run_gpu_checks.sh); the
CPU twins are tests/workers/test_worker_logprobs.py and test_worker_update.py.

Checks: fp32 log-probs equal HF's to 1e-3 (TF32 off); bf16 ones stay within a mean
absolute difference of 0.03 nats (bf16 rounding; a wrong weight mapping is off by whole nats);
one fp32 update gives the same weights packed and padded (1e-4), and with the response-row LM head as
with the full output layer (1e-4).
"""

import pytest
import torch

from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import free_port
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.config import BatchingConfig, OptimizerConfig, PolicyLossConfig, WorkerConfig
from rlmega.workers.worker import MegatronWorker

from .conftest import PROMPTS
from .measures import measured

pytestmark = pytest.mark.gpu


@pytest.fixture
def single_rank(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    initialize(ParallelLayout())
    yield ParallelLayout()
    destroy(including_default_group=True)


def _batch() -> SequenceBatch:
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.tensor(prompt + torch.randint(3, 512, (7 + 3 * i,), generator=generator).tolist())
              for i, prompt in enumerate(PROMPTS)]
    return SequenceBatch(tokens, [len(prompt) for prompt in PROMPTS])


def _hf_logprobs(hf_dir, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    logprobs = []
    with torch.no_grad():
        for tokens, prompt in zip(batch.tokens, batch.prompt_lengths):
            log_softmax = torch.log_softmax(model(tokens.unsqueeze(0)).logits[0].float(), dim=-1)[prompt - 1:-1]
            logprobs.append(log_softmax.gather(-1, tokens[prompt:].unsqueeze(-1))[:, 0])
    return logprobs


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_worker_logprobs_match_hf_on_gpu(single_rank, gpu_llama_dir, dtype, packing):
    config = WorkerConfig(role="ref", dtype=dtype, batching=BatchingConfig(packing=packing))
    worker = MegatronWorker(model_spec_from_hf(gpu_llama_dir), single_rank, config, hf_dir=gpu_llama_dir)
    batch = _batch()
    logprobs, _ = worker.compute_logprobs(batch)
    expected = _hf_logprobs(gpu_llama_dir, batch)
    differences = torch.cat([(got - want).abs() for got, want in zip(logprobs, expected)])
    measured(**{f"{dtype}_{'packed' if packing else 'padded'}_max": differences.max(),
                f"{dtype}_{'packed' if packing else 'padded'}_mean": differences.mean()})
    if dtype == "fp32":
        assert differences.max() <= 1e-3, differences.max()
    else:
        assert differences.mean() <= 0.03, differences.mean()


def _largest_difference(got: dict, want: dict) -> float:
    return max((tensor - want[name]).abs().max().item() for name, tensor in got.items())


def _updated_weights(layout, hf_dir, packing):
    config = WorkerConfig(
        role="actor", dtype="fp32", batching=BatchingConfig(packing=packing),
        optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, lr_schedule="constant"),
        policy_loss=PolicyLossConfig(name="ppo"),
    )
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    batch = _batch()
    old, _ = worker.compute_logprobs(batch)
    generator = torch.Generator().manual_seed(1)
    advantages = [torch.randn(n, generator=generator) for n in batch.response_lengths]
    worker.update(batch.with_fields(old_logp=old, advantages=advantages))
    return {name: tensor.float().cpu().clone() for name, tensor in worker.export_hf_weights()}


def test_packed_update_equals_padded_on_gpu(single_rank, gpu_llama_dir):
    packed = _updated_weights(single_rank, gpu_llama_dir, packing=True)
    padded = _updated_weights(single_rank, gpu_llama_dir, packing=False)
    assert packed.keys() == padded.keys()
    measured(max_abs_diff=_largest_difference(packed, padded))
    for name, tensor in packed.items():
        torch.testing.assert_close(tensor, padded[name], atol=1e-4, rtol=0, msg=name)


def test_response_row_logits_update_equals_the_full_output_layer_on_gpu(single_rank, gpu_llama_dir, monkeypatch):
    """The LM head of response rows (rlmega.workers.lm_head; with Megatron's fused weight-gradient kernel
    where apex or transformer-engine provides it) trains like Megatron's full output layer. CPU twin:
    tests/workers/test_lm_head.py."""
    from rlmega.workers import lm_head

    rows = _updated_weights(single_rank, gpu_llama_dir, packing=True)
    monkeypatch.setattr(lm_head, "install", lambda model, vocab_size: False)
    full = _updated_weights(single_rank, gpu_llama_dir, packing=True)
    assert rows.keys() == full.keys()
    measured(max_abs_diff=_largest_difference(rows, full))
    for name, tensor in rows.items():
        torch.testing.assert_close(tensor, full[name], atol=1e-4, rtol=0, msg=name)

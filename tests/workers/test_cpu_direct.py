"""A worker's steps without the CPU platform's mode (``rlmega.parallel.cpu_platform.direct``) are the steps under
it, bit for bit: three updates, the log-probs after them and the weights, for a dense model at one rank and at TP2
with sequence parallelism, and for an MoE model with expert parallelism. The default run is checked to have taken
the direct path (its first run of each kind proved it) and the other to have stayed under the mode."""

import os

import pytest
import torch

from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.config import OptimizerConfig, PolicyLossConfig, WorkerConfig
from worker_cases import make_batch

TIMEOUT_S = 300


def _steps(rank, world_size, layout, hf_dir, direct):
    from rlmega.parallel import cpu_platform
    from rlmega.workers.worker import MegatronWorker

    os.environ[cpu_platform.DIRECT_ENV] = "1" if direct else "0"
    initialize(layout)
    config = WorkerConfig(role="actor", optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, lr_schedule="constant"),
                          policy_loss=PolicyLossConfig(name="ppo", entropy_coeff=0.01),
                          sequence_parallel=layout.tp > 1)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    generator = torch.Generator().manual_seed(3)
    metrics = []
    for step in range(3):
        batch = make_batch(seed=step)
        advantages = [torch.randn(n, generator=generator) for n in batch.response_lengths]
        metrics.append(worker.update_on_policy(batch.with_fields(advantages=advantages))[0])
    logp, _ = worker.compute_logprobs(make_batch(seed=9))
    weights = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    verdicts = dict(cpu_platform._VERDICTS.get(worker.chunks[0], {}))
    destroy()
    return dict(metrics=metrics, logp=logp, weights=weights, verdicts=verdicts)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model,layout_args", [
    ("llama", dict(world_size=1)),
    ("llama", dict(tp=2, world_size=2)),
    ("qwen3-moe", dict(ep=2, world_size=2)),
], ids=["dense-tp1", "dense-tp2-sp", "moe-ep2"])
def test_steps_without_the_mode_equal_the_steps_under_it(checkpoints, model, layout_args):
    layout = ParallelLayout(**layout_args)
    hf_dir = str(checkpoints[model])
    under_mode, direct = (run_on_ranks(_steps, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, hf_dir, on))
                          for on in (False, True))
    for rank in range(layout.world_size):
        assert under_mode[rank]["verdicts"] == {}  # RLMEGA_CPU_DIRECT=0: never tried
        assert direct[rank]["verdicts"] == {("schedule", False, False): True, ("schedule", True, False): True,
                                            "optimizer step": True}
    first, second = under_mode[0], direct[0]
    for step, (a, b) in enumerate(zip(first["metrics"], second["metrics"])):
        timing = {name for name in a if name.startswith("perf/")}
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}, step
    for a, b in zip(first["logp"], second["logp"]):
        assert torch.equal(a, b)
    assert first["weights"].keys() == second["weights"].keys()
    for name, tensor in first["weights"].items():
        assert torch.equal(tensor, second["weights"][name]), name

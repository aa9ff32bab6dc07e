"""LoRA checkpoints hold the adapters alone (and their optimizer state) and resume in another layout to the same
next step; adapters folded into the base (after a warm-start) keep the model's output, make the base the adapted
model, and from then on checkpoints hold the whole model."""

import json

import pytest
import torch

from rlmega.models import lora, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.worker import MegatronWorker
from test_lora_update import _lora_config
from test_worker_update import _training_batch
from worker_cases import make_batch, saved_model_keys

TIMEOUT_S = 300


def _step(worker, seed):
    batch = make_batch(seed)
    old_logp, _ = worker.compute_logprobs(batch)
    return worker.update(_training_batch(batch, old_logp))


def _merged(worker):
    return {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}


def _save_body(rank, world_size, layout, hf_dir, root, fold):
    initialize(layout)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, _lora_config(), hf_dir=hf_dir)
    _step(worker, 5)
    folded = None
    if fold:
        before = worker.compute_logprobs(make_batch())[0]
        worker.fold_adapters()
        with lora.adapters_disabled(worker.chunks):
            base = worker.compute_logprobs(make_batch())[0]
        folded = before, worker.compute_logprobs(make_batch())[0], base
    worker.save_checkpoint(root)
    _step(worker, 6)
    merged = _merged(worker)
    destroy()
    return merged, folded


def _resume_body(rank, world_size, layout, hf_dir, root):
    initialize(layout)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, _lora_config(), hf_dir=hf_dir)
    worker.load_checkpoint(root)
    _step(worker, 6)
    merged = _merged(worker)
    destroy()
    return merged


@pytest.mark.parametrize("fold", [False, True], ids=["adapters", "folded"])
def test_lora_checkpoint_resumes_in_another_layout(checkpoints, tmp_path, fold):
    hf_dir, root = str(checkpoints["llama"]), tmp_path / "ckpt"
    saved_at = ParallelLayout(tp=2, world_size=2)
    want, folded = run_on_ranks(_save_body, 2, timeout_s=TIMEOUT_S, args=(saved_at, hf_dir, root, fold))[0]
    model_keys = saved_model_keys(root / "iter_0000001")
    metadata = json.loads((root / "iter_0000001" / "rlmega.json").read_text())
    if fold:
        assert metadata["model"] == "whole" and any(".linear_qkv.weight" in key for key in model_keys)
        before, after, base = folded
        for a, b, c in zip(before, after, base):  # the same model; its base is now the adapted one
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
            torch.testing.assert_close(c, a, atol=1e-5, rtol=0)
    else:
        assert metadata["model"] == "adapters"
        assert model_keys and all(lora.is_adapter_key(key) for key in model_keys)
    for layout in (ParallelLayout(world_size=1), ParallelLayout(pp=2, world_size=2)):
        got = run_on_ranks(_resume_body, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, hf_dir, root))[0]
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=name)

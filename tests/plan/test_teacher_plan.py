"""`rlmega plan` counts a distillation teacher's weights per GPU: measured in its own layout and dtype, on the
actor's GPUs in every phase, or offloaded: in the log-prob phase only and in host memory."""

import pickle
from pathlib import Path

import pytest

from rlmega.config import load_config
from rlmega.errors import UserError
from rlmega.plan import make_plan
from rlmega.plan.meta_build import measure_in_subprocess
from rlmega.plan.report import render

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "configs/recipes/qwen3_8b/grpo.yaml"
TEACHER = ["teacher.enable=true", "teacher.path=configs/recipes/qwen2_5_32b/hf", "teacher.layout.tp=4",
           "teacher.layout.world_size=8", "teacher.gpus_per_rank=0.5"]
QWEN2_5_32B_PARAMETERS = 32_763_876_352  # transformers' Qwen2ForCausalLM of that config.json, untied head


@pytest.fixture(autouse=True)
def _repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name their config.json relative to the checkout


@pytest.fixture(scope="module")
def measure():
    """``measure_in_subprocess`` once per distinct build (the plans below share the actor's and the teacher's)."""
    built = {}

    def cached(request):
        key = pickle.dumps(request)
        if key not in built:
            built[key] = measure_in_subprocess(request)
        return built[key]

    return cached


def _plan(measure, *overrides):
    return make_plan(load_config(RECIPE, list(overrides), check=False), RECIPE, measure=measure)


def test_a_teacher_on_the_actors_gpus_counts_in_every_phase_and_offloaded_in_the_logprob_phase(measure):
    base, resident, offloaded = (_plan(measure), _plan(measure, *TEACHER),
                                 _plan(measure, *TEACHER, "teacher.offload=true"))
    [teacher] = resident.teachers
    # bf16, the 32B model split over tp 4 (its embedding and head too): a quarter of its bytes per rank.
    assert teacher.colocated and teacher.ranks_per_gpu == 1 and teacher.dtype == "bf16"
    assert teacher.rank_bytes == pytest.approx(2 * QWEN2_5_32B_PARAMETERS / 4, rel=1e-3)
    [b], [r], [o] = base.positions, resident.positions, offloaded.positions
    for phase in ("generate", "logprobs", "update", "sync"):
        assert r.phases[phase] - b.phases[phase] == pytest.approx(teacher.rank_bytes), phase
        grown = o.phases[phase] - b.phases[phase]
        assert grown == pytest.approx(teacher.rank_bytes if phase == "logprobs" else 0.0), phase
    assert o.host - b.host == pytest.approx(teacher.rank_bytes) and r.host == b.host
    assert resident.nodes == base.nodes
    assert "teacher    teacher: tp=4" in render(offloaded) and "in host memory between uses" in render(offloaded)


def test_a_teacher_with_gpus_of_its_own_adds_nodes_and_fp32_doubles_its_bytes(measure):
    bf16 = _plan(measure, *TEACHER)
    own = _plan(measure, *TEACHER, "teacher.gpus_per_rank=1", "teacher.dtype=fp32")
    [teacher] = own.teachers
    assert not teacher.colocated and teacher.gpus == 8 and teacher.rank_bytes == pytest.approx(
        2 * bf16.teachers[0].rank_bytes)
    assert own.nodes == bf16.nodes + 1  # 8 more GPUs, 8 per node
    [b], [o] = bf16.positions, own.positions
    assert o.phases["update"] == pytest.approx(b.phases["update"] - bf16.teachers[0].rank_bytes)


def test_a_teacher_that_cannot_be_built_is_named(measure):
    with pytest.raises(UserError, match=r"^teacher: .*"):
        _plan(measure, *TEACHER, "teacher.layout.tp=3", "teacher.layout.world_size=3")

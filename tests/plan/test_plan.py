"""`rlmega plan`: every shipped recipe fits as its README says; the 671B recipe's parameter and gradient
bytes are exactly those of independently built ranks; a layout that does not fit is refused by rank."""

import json
from pathlib import Path

import pytest

from meta_ranks import count_ranks
from rlmega.cli.main import main
from rlmega.config import load_config
from rlmega.plan import make_plan

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "configs" / "recipes").glob("*/*.yaml"))
DEEPSEEK = "configs/recipes/deepseek_v3_671b/grpo.yaml"


@pytest.fixture(autouse=True)
def _repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name their config.json relative to the checkout


def test_there_is_a_recipe_per_model():
    assert [Path(r).parent.name for r in RECIPES] == ["deepseek_v3_671b", "qwen2_5_32b", "qwen3_235b_a22b", "qwen3_30b_a3b", "qwen3_8b"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_fits_as_its_readme_shows(recipe, capsys, tmp_path):
    assert main(["plan", recipe, "--json", str(tmp_path / "plan.json")]) == 0
    table = capsys.readouterr().out
    assert "fits: at least" in table and "DOES NOT FIT" not in table
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["fits"] and all(p["free"] >= plan["min_headroom"] for p in plan["positions"])
    readme = (ROOT / recipe).parent / "README.md"
    # The README quotes the table as this code prints it today (regenerate it when the recipe changes).
    assert "\n".join(table.splitlines()[1:]) in readme.read_text(), f"{readme} quotes an outdated plan"


def test_the_671b_plan_counts_exactly_what_each_rank_builds():
    """First, middle and last pipeline stages, several expert ranks of each: parameter and gradient bytes
    equal those of the rank's own model, built on the meta device under a fake process group of 256."""
    plan = make_plan(load_config(DEEPSEEK, check=False), DEEPSEEK)
    assert [p.stages for p in plan.positions] == [[0], list(range(1, 15)), [15]]
    ranks = [0, 5, 15, 16, 37, 128, 239, 240, 247, 255]
    built = count_ranks(DEEPSEEK, ranks)
    assert {built[r]["expert_rank"] for r in ranks} >= {0, 5, 15, 7}
    for rank in ranks:
        actor = plan.position_of_rank(rank).roles["actor"]
        assert built[rank]["pipeline_rank"] == rank // 16
        assert (actor.params, actor.param_elements, actor.grads) == (
            built[rank]["param_bytes"], built[rank]["param_numel"], built[rank]["grad_bytes"]), f"rank {rank}"
    assert plan.position_of_rank(5).roles["actor"].param_elements == 2_682_634_240  # 3 dense layers + embedding
    # Every tensor of transformers' DeepseekV3ForCausalLM state dict (its parameters and the routers'
    # e_score_correction_bias buffers), counted on the meta device.
    assert plan.parameters == 671_026_419_200
    # The refit streams the whole model (bf16) from trainer rank 0 to every engine GPU, MTP left out.
    assert plan.refit.bytes_per_sync == 2 * plan.parameters


@pytest.mark.parametrize("recipe", [DEEPSEEK, "configs/recipes/qwen3_235b_a22b/grpo.yaml"])
def test_the_optimizer_bytes_are_those_the_worst_rank_of_each_position_allocates(recipe):
    """Each position's rank with the largest shard, built on its own with the worker's optimizer and a step:
    its fp32 masters, Adam moments and gradient copies, by where a GPU run keeps them, are the plan's."""
    plan = make_plan(load_config(recipe, check=False), recipe)
    worst = [p.worst_rank for p in plan.positions]
    assert len(worst) == 3
    built = count_ranks(recipe, worst, with_optimizer=worst)
    for position, rank in zip(plan.positions, worst):
        actor = position.roles["actor"]
        assert built[rank]["optimizer"] == {"gpu": actor.optimizer_gpu, "host": actor.optimizer_host}, f"rank {rank}"
        # Offloaded whole (cpu_offload_fraction 1): nothing on the GPU, 16 bytes per owned element in host memory.
        assert actor.optimizer_gpu == 0 and actor.optimizer_host == 16 * actor.owned_elements
        assert (actor.params, actor.grads) == (built[rank]["param_bytes"], built[rank]["grad_bytes"])


def test_a_layout_that_does_not_fit_is_refused_naming_the_rank_and_the_shortfall(capsys):
    # The optimizer on the GPU, and the engine kept beside the training state.
    assert main(["plan", DEEPSEEK, "actor.optimizer.cpu_offload_fraction=0", "rollout.colocated_offload=never"]) == 2
    captured = capsys.readouterr()
    assert "DOES NOT FIT: rank 16 (pipeline stage 1 of 16) needs" in captured.out
    [line] = captured.err.strip().splitlines()
    assert line.startswith(f"rlmega plan: {DEEPSEEK}: does not fit: rank ")
    assert "in the update phase" in line and "short by" in line and "actor optimizer 32.1" in line


def test_a_layout_that_cannot_split_the_model_gets_working_ones_proposed(capsys):
    assert main(["plan", DEEPSEEK, "layout.first_stage_layers=null", "layout.last_stage_layers=null"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == ("rlmega plan: layout: num_layers=61 is not divisible by pp*vpp = 16*1 = 16; with pp=16: set "
                    "first_stage_layers=3 last_stage_layers=2 (4 on each other stage) or set first_stage_layers=2 "
                    "last_stage_layers=3 (4 on each other stage); pp values that split it evenly: 1, 61")


def test_mtp_on_adds_the_layer_to_the_last_stage_and_to_the_sync():
    config = load_config("configs/recipes/qwen3_8b/grpo.yaml", check=False)
    assert config.model.mtp == "auto"
    plan = make_plan(load_config(DEEPSEEK, ["model.mtp=on"], check=False))
    last = plan.position_of_rank(255)
    assert last.layers == "2 moe + 1 mtp"
    assert plan.mtp_parameters > 11e9 and plan.refit.bytes_per_sync == 2 * (plan.parameters + plan.mtp_parameters)


def test_recomputation_and_offload_change_the_plan_where_the_formulas_say():
    base = make_plan(load_config("configs/recipes/qwen3_8b/grpo.yaml", check=False))
    none = make_plan(load_config("configs/recipes/qwen3_8b/grpo.yaml", ["actor.recompute_granularity=null"], check=False))
    [b], [n] = base.positions, none.positions
    assert b.activations["configured"] == b.activations["full"] < n.activations["configured"] == n.activations["none"]
    assert b.roles["actor"].params == n.roles["actor"].params and b.roles["actor"].grads == n.roles["actor"].grads
    offloaded = make_plan(load_config("configs/recipes/qwen3_8b/grpo.yaml", ["actor.optimizer.cpu_offload_fraction=1"],
                                      check=False))
    [o] = offloaded.positions
    assert o.roles["actor"].optimizer_gpu == 0 and o.roles["actor"].optimizer_host == b.roles["actor"].owned_elements * 16
    assert o.phases["update"] == pytest.approx(b.phases["update"] - b.roles["actor"].optimizer_gpu)
    assert o.phases["sync"] == pytest.approx(b.phases["sync"])  # the optimizer leaves the GPU for the sync either way


@pytest.mark.parametrize("degrees", [dict(tp=2, pp=2, ep=4, world_size=32), dict(tp=2, cp=2, ep=2, etp=2, world_size=16),
                                     dict(pp=4, ep=8, world_size=64), dict(tp=4, pp=2, ep=2, etp=2, world_size=32)])
def test_the_rank_order_the_planner_assumes_is_megatrons(degrees):
    """Which optimizer shard and which sync tensors a rank has follow from its place in its stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rlmega.parallel.layout import ParallelLayout
    from rlmega.plan.meta_build import StageCoordinates

    layout = ParallelLayout(**degrees)
    per_stage = layout.world_size // layout.pp
    for rank in range(layout.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.expert_tp, create_gloo_process_groups=False)
            at = StageCoordinates.of(rank % per_stage, layout)
            assert (ps.get_pipeline_model_parallel_rank(), at) == (rank // per_stage, StageCoordinates(
                tp_rank=ps.get_tensor_model_parallel_rank(),
                data_parallel_index=ps.get_data_parallel_rank(with_context_parallel=True),
                expert_tp_rank=ps.get_expert_tensor_parallel_rank(), expert_rank=ps.get_expert_model_parallel_rank(),
                expert_data_parallel_rank=ps.get_expert_data_parallel_rank())), f"rank {rank}"
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def test_colocated_parts_kept_resident_are_counted_together_in_every_phase():
    base = make_plan(load_config("configs/recipes/qwen3_8b/grpo.yaml", check=False))
    resident = make_plan(load_config("configs/recipes/qwen3_8b/grpo.yaml", ["rollout.colocated_offload=never"],
                                     check=False))
    [b], [r] = base.positions, resident.positions
    assert r.phases["generate"] > b.phases["generate"]  # the training state stays while the engine generates
    # ... and the engine while training runs: by the same amount in both training phases.
    engine = r.phases["update"] - b.phases["update"]
    assert engine > 0 and r.phases["logprobs"] - b.phases["logprobs"] == pytest.approx(engine)
    # Handing over, the trainer frees the gradients and moves the optimizer to host before the engine wakes for the
    # sync; kept resident, it has no reason to.
    actor = b.roles["actor"]
    assert actor.grads > 0 and actor.optimizer_gpu > 0
    assert r.phases["sync"] - b.phases["sync"] == pytest.approx(actor.grads + actor.optimizer_gpu)
    assert r.host < b.host  # nothing is parked in host memory


def test_explain_lists_every_term_the_verdict_adds_up_each_with_its_source(capsys, tmp_path):
    recipe = "configs/recipes/qwen3_30b_a3b/dapo.yaml"
    overrides = ["actor.policy_loss.kl_loss_coef=0.001", "ref.offload=true"]  # a reference, offloaded: host terms too
    assert main(["plan", recipe, *overrides, "--explain", "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    explained = out.split("Every term of the plan")[1]
    sections = explained.split("\n\n")[1:1 + len(plan["positions"])]
    sources = dict(line.strip().split(" ", 1) for line in explained.split("sources:\n")[1].splitlines() if line.strip().startswith("["))
    for section, position in zip(sections, plan["positions"]):
        rows = [line.split() for line in section.splitlines()[2:]]
        terms = [row for row in rows if row[-1].startswith("[") and row[0] != "host:"]
        assert terms and all(row[-1] in sources for row in rows if row[-1].startswith("["))
        for column, phase in enumerate(("generate", "logprobs", "update", "sync")):
            cells = [row[-5 + column] for row in terms]
            total = sum(float(cell) for cell in cells if cell != "-")
            # Each term is printed to 0.01 GiB: the sum of the printed terms is the phase within their rounding.
            assert total == pytest.approx(position["phases"][phase] / 2**30, abs=0.005 * len(cells) + 1e-9), phase
        assert any(row[:2] == ["ref", "parameters"] and row[-5] == "-" for row in terms)  # offloaded while generating
        host = [row for row in rows if row[0] == "host:"]
        assert any("ref" in row for row in host)
        assert sum(float(row[-2]) for row in host) == pytest.approx(position["host"] / 2**30, abs=0.005 * len(host))
    assert {source for phase in plan["positions"][0]["terms"].values() for source in (t["source"] for t in phase)} \
        <= set(plan["sources"])
    assert "measured:" in explained and "formula:" in explained and "config:" in explained

"""ParallelLayout validation: impossible layouts fail at start-up naming the numbers."""

import pytest

from rlmega.parallel.layout import LayoutError, ParallelLayout


def test_dp_is_derived_from_world_size():
    layout = ParallelLayout(tp=2, pp=2, world_size=8)
    assert layout.dp == 2
    assert layout.expert_dp == 2  # etp follows tp without ep: 8 / (pp 2 * ep 1 * etp 2)


def test_expert_layout_refolds_the_same_ranks():
    layout = ParallelLayout(tp=2, ep=4, world_size=8)
    assert (layout.dp, layout.expert_tp, layout.expert_dp) == (4, 1, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=2, pp=2, world_size=6), "world size 6 is not divisible by tp*cp*pp = 2*1*2 = 4"),
        (dict(tp=3, world_size=4), "world size 4 is not divisible by tp*cp*pp = 3*1*1 = 3"),
        (dict(pp=1, vpp=2, world_size=2), "vpp=2 needs pipeline parallelism, but pp=1"),
        (dict(ep=4, world_size=2), "ep*etp = 4*1 must divide tp*cp*dp = 1*1*2 = 2"),
        (dict(tp=0, world_size=2), "tp=0 must be at least 1"),
    ],
)
def test_impossible_world_layouts_name_their_numbers(kwargs, message):
    with pytest.raises(LayoutError) as error:
        ParallelLayout(**kwargs)
    assert str(error.value) == message
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "layout, model, message",
    [
        (dict(tp=3, world_size=3), dict(num_attention_heads=4),
         "num_attention_heads=4 is not divisible by tp=3; valid tp: 1, 2, 4"),
        (dict(tp=4, world_size=4), dict(num_attention_heads=8, num_query_groups=2),
         "num_query_groups=2 is not divisible by tp=4; valid tp: 1, 2"),
        (dict(pp=2, vpp=2, world_size=2), dict(num_attention_heads=4, num_layers=6),
         "num_layers=6 is not divisible by pp*vpp = 2*2 = 4; uneven stages need vpp=1; "
         "pp*vpp values that split it evenly: 1, 2, 3, 6"),
        (dict(ep=2, world_size=2), dict(num_attention_heads=4, num_experts=3),
         "num_experts=3 is not divisible by ep=2; valid ep: 1"),
        (dict(ep=2, world_size=2), dict(num_attention_heads=4), "ep=2 needs a MoE model, but the model has no experts"),
        (dict(ep=4, etp=2, world_size=4), dict(num_attention_heads=4, num_experts=4, expert_ffn_hidden_size=6),
         "ep*etp = 4*2 must divide tp*cp*dp = 1*1*4 = 4"),
        (dict(ep=2, etp=4, world_size=8), dict(num_attention_heads=4, num_experts=4, expert_ffn_hidden_size=6),
         "the experts' ffn_hidden_size=6 is not divisible by etp=4; valid etp: 1, 2"),
        (dict(tp=2, etp=1, world_size=2), dict(num_attention_heads=4), "etp=1 splits experts, but the model has none; leave etp unset"),
    ],
)
def test_model_mismatches_name_their_numbers_and_propose_valid_ones(layout, model, message):
    model.setdefault("num_layers", 4)
    try:
        with pytest.raises(LayoutError) as error:
            ParallelLayout(**layout).check_model(**model)
    except LayoutError as construction:  # the world cannot hold it at all: refused when built
        error = None
        assert str(construction) == message
    if error is not None:
        assert str(error.value) == message


def test_a_layer_count_no_pipeline_splits_evenly_gets_uneven_stages_proposed():
    """DeepSeek-V3's 61 layers: every pp > 1 needs uneven stages; the proposal is a working one."""
    with pytest.raises(LayoutError) as error:
        ParallelLayout(pp=16, ep=16, world_size=256).check_model(num_layers=61, num_attention_heads=128, num_experts=256)
    assert str(error.value) == (
        "num_layers=61 is not divisible by pp*vpp = 16*1 = 16; with pp=16: set first_stage_layers=3 "
        "last_stage_layers=2 (4 on each other stage) or set first_stage_layers=2 last_stage_layers=3 "
        "(4 on each other stage); pp values that split it evenly: 1, 61")
    ParallelLayout(pp=16, ep=16, world_size=256, first_stage_layers=3, last_stage_layers=2).check_model(
        num_layers=61, num_attention_heads=128, num_experts=256)
    with pytest.raises(LayoutError, match="leaves 57 layers, which do not split evenly over the other 14 stage"):
        ParallelLayout(pp=16, world_size=16, first_stage_layers=2, last_stage_layers=2).check_model(
            num_layers=61, num_attention_heads=128)


def test_context_parallel_is_accepted_with_or_without_transformer_engine():
    ParallelLayout(cp=2, tp=2, world_size=8).check_model(num_layers=4, num_attention_heads=4)


def test_describe_lists_every_degree():
    text = ParallelLayout(tp=2, pp=2, vpp=2, world_size=8).describe()
    assert text == "tp=2 pp=2 vpp=2 cp=1 ep=1 etp=2 dp=2 (world 8)"
    text = ParallelLayout(pp=4, world_size=4, first_stage_layers=1, last_stage_layers=2).describe()
    assert text == "tp=1 pp=4 first_stage_layers=1 last_stage_layers=2 cp=1 ep=1 etp=1 dp=1 (world 4)"


def test_initialize_without_a_launcher_says_what_is_missing(monkeypatch):
    from rlmega.parallel.layout import initialize

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set; launch with torchrun"):
        initialize(ParallelLayout())


def test_initialize_starts_gloo_from_torchrun_variables_and_tears_down():
    import os
    import subprocess
    import sys

    from rlmega.parallel.spawn import free_port

    script = (
        "import torch.distributed as dist\n"
        "from megatron.core import parallel_state\n"
        "from rlmega.parallel.layout import ParallelLayout, initialize, destroy\n"
        "initialize(ParallelLayout())\n"
        "print(dist.get_backend(), parallel_state.model_parallel_is_initialized())\n"
        "destroy(including_default_group=True)\n"
        "print(dist.is_initialized(), parallel_state.model_parallel_is_initialized())\n"
    )
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["gloo True", "False False"]


def test_uneven_stages_must_split_the_rest_evenly():
    ParallelLayout(pp=3, first_stage_layers=1, world_size=3).check_model(num_layers=5, num_attention_heads=4)
    ParallelLayout(pp=2, first_stage_layers=1, last_stage_layers=3, world_size=2).check_model(num_layers=4, num_attention_heads=4)
    with pytest.raises(LayoutError) as error:
        ParallelLayout(pp=3, first_stage_layers=1, world_size=3).check_model(num_layers=6, num_attention_heads=4)
    assert str(error.value) == (
        "num_layers=6 minus first_stage_layers=1 and last_stage_layers=0 leaves 5 layers, "
        "which do not split evenly over the other 2 stage(s); with pp=3: leave both unset (2 on every stage) "
        "or set first_stage_layers=2 last_stage_layers=1 (3 on each other stage) or set first_stage_layers=1 "
        "last_stage_layers=2 (3 on each other stage); "
        "pp values that split it evenly: 1, 2, 3, 6"
    )
    with pytest.raises(LayoutError, match="uneven pipeline stages with vpp=2 are not supported"):
        ParallelLayout(pp=2, vpp=2, first_stage_layers=1, world_size=2)
    with pytest.raises(LayoutError, match="need pipeline parallelism, but pp=1"):
        ParallelLayout(last_stage_layers=1)

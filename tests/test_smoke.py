"""`rlmega smoke`: real Megatron training on CPU ranks whose loss visibly falls."""

import re

from rlmega.cli.main import main


def test_smoke_learns_at_tensor_parallel_2(capfd):  # ranks print from their own processes
    assert main(["smoke", "--steps", "25"]) == 0
    out = capfd.readouterr().out
    assert "tp=2 pp=1 cp=1 ep=1 etp=2 dp=1 (world 2)" in out
    losses = [float(x) for x in re.findall(r"step +\d+/25 .* loss (\d+\.\d+)", out)]
    assert len(losses) == 25  # one live line per step
    assert losses[-1] < 0.7 * losses[0]  # ln(1024) = 6.93 at the start; counting is learnable


def test_smoke_refuses_an_impossible_layout_before_starting(capsys):
    assert main(["smoke", "--tp", "3"]) == 2
    assert capsys.readouterr().out.strip() == "rlmega smoke: num_attention_heads=4 is not divisible by tp=3; valid tp: 1, 2"


def test_smoke_refuses_uneven_data_split(capsys):
    assert main(["smoke", "--tp", "1", "--dp", "3"]) == 2
    assert "--micro-batches 4 must be divisible by --dp 3" in capsys.readouterr().out

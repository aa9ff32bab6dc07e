"""sync.transport=sharded_rdt's needs (Ray >= 2.56 and nixl, from vLLM's sharded_rdt_common.py): setup.py's extra
installs them, and the transfer refuses to start, naming what is missing, where they are not installed."""

import ast
from pathlib import Path

import pytest

from rlmega.sync import sharded_rdt_needs

SETUP = Path(__file__).resolve().parents[2] / "setup.py"


def _extras() -> dict:
    for node in ast.walk(ast.parse(SETUP.read_text())):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "EXTRAS_REQUIRE":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no EXTRAS_REQUIRE")


def test_the_extra_installs_what_the_transport_needs():
    assert _extras()["sharded_rdt"] == sharded_rdt_needs.EXTRA
    assert any(requirement.startswith("ray[default]>=2.56") for requirement in sharded_rdt_needs.EXTRA)
    assert any(requirement.startswith("nixl") for requirement in sharded_rdt_needs.EXTRA)


@pytest.mark.parametrize("versions, lacking", [
    ({"ray": "2.40.0"}, ["ray>=2.56 (installed: 2.40.0)", "nixl (not installed)"]),
    ({"ray": "2.56.0"}, ["nixl (not installed)"]),
    ({"ray": "2.60.1", "nixl": "1.5.1"}, []),
    ({"nixl": "1.5.1"}, ["ray>=2.56 (installed: none)"]),
])
def test_what_is_missing_is_named(versions, lacking):
    assert sharded_rdt_needs.missing(versions.get) == lacking


def test_the_transfer_refuses_to_start_without_them(monkeypatch):
    from rlmega.sync.vllm_sharded import ShardedSync

    monkeypatch.setattr(sharded_rdt_needs, "installed_version", {"ray": "2.48.0"}.get)
    with pytest.raises(RuntimeError, match=r"sync.transport=sharded_rdt needs ray>=2.56 \(installed: 2.48.0\) and "
                                           r"nixl \(not installed\): pip install 'rlmega\[sharded_rdt\]'"):
        ShardedSync([], None, None)

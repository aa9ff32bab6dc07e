"""rlmega.data and rlmega.rewards stay free of the training stack, so reward workers start fast and light."""

import subprocess
import sys

FORBIDDEN = ("megatron", "ray", "torch", "transformers", "rlmega.workers", "rlmega.trainer", "rlmega.rollout")


def test_data_and_rewards_import_nothing_heavy():
    code = (
        "import sys, rlmega.data, rlmega.rewards, rlmega.rewards._worker\n"
        f"print(sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {FORBIDDEN!r})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"

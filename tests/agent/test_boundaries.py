"""rlmega.agent knows tokenizers and engines, never Megatron or the trainer; its tool workers start light."""

import subprocess
import sys

HEAVY = ("megatron", "ray", "rlmega.workers", "rlmega.trainer")


def _imported(code: str, names) -> list[str]:
    script = (f"{code}\nimport sys\nnames = {tuple(names)!r}\n"
              "print(sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in names)))")
    return eval(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)


def test_the_loop_imports_no_training_stack():
    assert _imported("import rlmega.agent.loop", HEAVY) == []


def test_the_package_and_the_tool_worker_import_no_torch():
    assert _imported("import rlmega.agent, rlmega.agent._tool_worker, rlmega.agent.builtin",
                     ("torch", "transformers", *HEAVY)) == []

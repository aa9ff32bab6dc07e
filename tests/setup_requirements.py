"""setup.py's requirements, read without running it (the version and pin tests compare them with what resolves)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """``INSTALL_REQUIRES`` and ``EXTRAS_REQUIRE``, read from setup.py without running it."""
    values = {}
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("INSTALL_REQUIRES", "EXTRAS_REQUIRE"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    return values["INSTALL_REQUIRES"], values["EXTRAS_REQUIRE"]

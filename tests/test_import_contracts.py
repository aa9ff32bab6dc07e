"""rlmega's layers hold: import-linter checks ``tests/import_contracts.ini`` (each package on those below it,
Ray only in the trainer and the launchers, the algorithms on torch alone, the converters on the bridge, the
models and the parallel layer, no circle between the modules of a package)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache", str(ROOT / "tests" / "import_contracts.ini")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout

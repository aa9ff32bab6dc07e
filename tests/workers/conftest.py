import sys
from pathlib import Path

# The tiny HF checkpoints of every architecture live with the bridge tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bridge"))

"""``python -m converters ...``: the same command line as ``rlmega convert ...``."""

import sys

from converters.cli import main

sys.exit(main())

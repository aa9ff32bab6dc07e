"""``python -m rlmega.cli ...``: the ``rlmega`` command."""

import sys

from rlmega.cli.main import main

sys.exit(main())

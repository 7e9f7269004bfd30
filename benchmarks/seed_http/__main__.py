"""``python -m benchmarks.seed_http``: see the package's docstring or ``--help``."""

import sys

from benchmarks.seed_http._cli import main

sys.exit(main())

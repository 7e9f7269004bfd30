"""``python -m benchmarks.frontend_table``: see the package's docstring or ``--help``."""

import sys

from benchmarks.frontend_table._cli import main

sys.exit(main())

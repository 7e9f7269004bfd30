"""``python -m tserve.bench``: the same as ``python -m tserve bench``."""

import sys

from tserve.bench._cli import main

sys.exit(main())

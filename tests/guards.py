"""The hang guard every test waits under: a bound that only a hang reaches.

Generous on purpose. On a 2-core machine at five times its load an engine
process takes over a minute to import torch and load the tiny model, and a
guard that a slow machine can reach is a race. A guard is never a timing
assertion: a test that needs it to pass is broken, and one that reaches it
has hung.
"""

from __future__ import annotations

from typing import Final

HANG_GUARD: Final = 300  # seconds (an int: some tests count polls with it)

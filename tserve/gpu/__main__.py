"""Entry point of the engine process: ``python -m tserve.gpu ADDRESS CONFIG_JSON``.

Started by an API process (see ``tserve.nursery``), which passes its own pid
with ``--parent-pid`` so the engine can exit when it is gone.

Exit status: 0 after ``Shutdown`` or when the parent is gone; 1 after a fatal
error, which every connected API process first hears about as ``EngineDead``;
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

from tserve._host import configure_logging, own_process_group
from tserve.protocol import EngineConfig


def main(argv: list[str] | None = None) -> int:
    own_process_group()  # Ctrl-C at the terminal reaches the API process alone
    parser = argparse.ArgumentParser(prog="python -m tserve.gpu", description=__doc__)
    parser.add_argument("address", help="ZMQ address to bind the engine's ROUTER to")
    parser.add_argument("config", help="EngineConfig as JSON")
    parser.add_argument("--parent-pid", type=int, default=os.getppid())
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, who="engine")
    try:
        config = msgspec.json.decode(args.config, type=EngineConfig)
    except msgspec.DecodeError as exc:
        parser.error(f"bad CONFIG_JSON: {exc}")
    # Import late: loading torch takes a while and argument errors should not wait.
    from tserve.gpu.engine._process import run_engine

    return run_engine(config, args.address, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())

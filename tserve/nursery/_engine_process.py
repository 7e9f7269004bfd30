"""Start and stop the engine process.

The engine listens on an ``ipc://`` socket inside a fresh directory that only
this user can enter (``mkdtemp`` makes it 0700); the directory is removed on
exit. The engine is told our pid and exits by itself within about a second if
we die without stopping it (SIGKILL, ``os._exit``), so it can never be left
holding the device. It runs in a session (and so a process group) of its
own: a Ctrl-C in a terminal, or a supervisor's SIGTERM to the server's
process group, reaches only the API process, which drains its requests and
then stops the engine itself. (The engine also ignores SIGINT, for the
launchers that start it some other way.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import msgspec

from tserve.mux import Link
from tserve.protocol import EngineConfig

__all__ = ["EngineProcess", "EngineRef", "exit_reason", "start_engine"]


class EngineRef:
    """An engine by its socket address: how to reach it and how to watch it.

    On this host, by pid: one this process started (:class:`EngineProcess`,
    which also owns its lifetime) or one another API process started and
    shares with us. Or by address alone (``pid`` None, a ``link``): a
    ``tserve engine`` anywhere, whose liveness comes from its connection.
    """

    def __init__(self, address: str, pid: int | None, link: Link | None = None) -> None:
        if pid is None and link is None:
            raise ValueError("an engine without a pid on this host needs a Link")
        self.address = address
        self.pid = pid
        self.link = link

    def kill(self) -> None:
        """SIGKILL the engine (tests and drills use this to simulate a crash).

        Raises ValueError for an engine reached by address alone.
        """
        if self.pid is None:
            raise ValueError(f"the engine at {self.address} is not a process of this host")
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class EngineProcess(EngineRef):
    """A running engine process that this process owns, as :func:`start_engine` yields it."""

    def __init__(self, process: anyio.abc.Process, address: str) -> None:
        super().__init__(address, process.pid)
        self.pid: int = process.pid
        self.process = process

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    async def wait(self) -> int:
        """Wait until the process has exited; return its code. Cancellable."""
        return await self.process.wait()

    async def stop(self, grace: float) -> None:
        """Wait up to ``grace`` s for a requested exit, then SIGTERM, then SIGKILL.

        Shielded: it runs to completion even inside a cancelled scope, so
        leaving any block that started an engine never leaves it running.
        Bound: ``grace`` + 3 s + 5 s.
        """
        with anyio.CancelScope(shield=True):
            for sig, wait in ((None, grace), (signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
                if sig is not None and self.process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        self.process.send_signal(sig)
                with anyio.move_on_after(wait):
                    await self.process.wait()
                if self.process.returncode is not None:
                    return


def exit_reason(code: int) -> str:
    """Words for an engine's exit status, for EngineDeadError."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the engine process was killed by {name}"
    return f"the engine process exited with code {code}"


@contextlib.asynccontextmanager
async def start_engine(
    config: EngineConfig, *, log_level: str = "INFO", stop_grace: float = 5.0
) -> AsyncIterator[EngineProcess]:
    """Run an engine process for the duration of the block.

    The engine inherits stdout and stderr (its log, including its loading
    progress, appears there). On leaving the block the engine is given
    ``stop_grace`` seconds to finish a Shutdown the caller sent, then
    terminated (see :meth:`EngineProcess.stop`), whatever way the block is
    left; the socket directory is removed.
    """
    directory = tempfile.mkdtemp(prefix="tserve-")
    address = f"ipc://{directory}/engine.sock"
    command = [
        sys.executable,
        "-m",
        "tserve.gpu",
        address,
        msgspec.json.encode(config).decode(),
        "--parent-pid",
        str(os.getpid()),
        "--log-level",
        log_level,
    ]
    try:
        process = await anyio.open_process(
            command,
            stdin=subprocess.DEVNULL,
            stdout=None,
            stderr=None,
            # The engine moves to a process group of its own (own_process_group):
            # signals to ours pass it by, and it stays in our session.
        )
        engine = EngineProcess(process, address)
        try:
            yield engine
        finally:
            await engine.stop(stop_grace)
            with anyio.CancelScope(shield=True):
                await process.aclose()
    finally:
        shutil.rmtree(directory, ignore_errors=True)

"""Stored responses: one directory that every API process of a server shares.

Where responses live: in files, one per response, in a directory of the
server (``--responses-store-dir``, by default a private directory that
``serve`` makes on ``/dev/shm`` where it exists and removes at exit). With
``--api-processes N`` the kernel spreads connections over N processes
(SO_REUSEPORT), so a continuation (``previous_response_id``), a GET or a
cancel can land on any of them; each reads the same files, so each answers
alike. No process owns a stored response; a background response's
generation is owned by the process that started it (it writes the file as
the status changes), and a cancel that lands elsewhere leaves a marker file
that the owner notices within :data:`CANCEL_POLL` seconds.

Rules:

* A record is ``{"response", "input_items"}`` as JSON in ``<id>.json``,
  written whole to a temporary name and renamed over (a reader sees the old
  record or the new one, never a part). Its mtime is the time of its first
  write (set again after each rewrite): the order of eviction and the start
  of its age.
* Bounds: the files hold at most ``max_bytes`` (``--responses-store-bytes``)
  and none is older than ``ttl`` seconds (``--responses-store-ttl``). A
  read past the age is "not found" at once; the bytes are enforced by a
  sweep that deletes the expired files, then the oldest ones, until the rest
  fit. Each process sweeps after it has written ``max_bytes / 16`` bytes
  since its last sweep (in a worker thread when the server owns the store:
  :meth:`Responses.run`), so the directory exceeds the budget by that much
  per process between sweeps, and by what is written while one runs. A
  record larger than ``max_bytes / 16`` is not stored (it is "not found"
  later, as an evicted one).
* Ids are ``resp_`` and 32 hex digits; any other id is "not found" without
  touching the filesystem.
* Blocking: every call does small synchronous file operations (no fsync;
  the store does not survive a restart). A write is one file of the
  record's size; a sweep lists the directory, which holds at most a few
  thousand records at the default budget.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import msgspec

__all__ = [
    "CANCEL_POLL",
    "DEFAULT_STORE_BYTES",
    "DEFAULT_STORE_TTL",
    "ResponseStore",
    "StoredResponse",
    "responses_store_dir",
]

JSON = dict[str, Any]

DEFAULT_STORE_BYTES: Final = 64 * 1024 * 1024
DEFAULT_STORE_TTL: Final = 24 * 3600.0
CANCEL_POLL: Final = 0.25  # seconds between an owner's looks for a cancel marker
_SWEEP_FRACTION: Final = 16
_ID: Final = re.compile(r"resp_[0-9a-f]{32}")
_ENCODER: Final = msgspec.json.Encoder()


class StoredResponse(msgspec.Struct, kw_only=True):
    response: JSON
    input_items: list[JSON]


class ResponseStore:
    """The shared store of one server's responses (see the module docstring)."""

    def __init__(
        self,
        directory: str | None,
        *,
        max_bytes: int,
        ttl: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``clock``: the wall-clock time records are aged by (file mtimes are on it)."""
        self._clock = clock
        self._own: tempfile.TemporaryDirectory[str] | None = None
        if directory is None:  # a server without a shared directory keeps a private one
            self._own = tempfile.TemporaryDirectory(prefix="tserve-responses-")
            directory = self._own.name
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._written = 0  # bytes written since this process's last sweep
        # Called (synchronously) when a sweep is due; None: sweep at once, here.
        self.on_sweep_due: Callable[[], None] | None = None

    def close(self) -> None:
        """Remove the private directory, if this store made one. Synchronous."""
        if self._own is not None:
            self._own.cleanup()

    def _path(self, response_id: str, suffix: str = ".json") -> Path | None:
        if not _ID.fullmatch(response_id):
            return None
        return self.directory / f"{response_id}{suffix}"

    def put(self, record: StoredResponse) -> bool:
        """Store ``record`` (a new one, or over the same id). False when it is too large."""
        response_id = record.response["id"]
        path = self._path(response_id)
        assert path is not None, response_id
        data = _ENCODER.encode(record)
        if len(data) > self.max_bytes // _SWEEP_FRACTION:
            self.delete(response_id)
            return False
        try:  # a rewrite keeps the first write's time: the record's age and place in line
            created = path.stat().st_mtime
        except FileNotFoundError:
            created = self._clock()
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.utime(tmp, (created, created))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._written += len(data)
        if self._written * _SWEEP_FRACTION >= self.max_bytes:
            self._written = 0
            if self.on_sweep_due is None:
                self.sweep()
            else:
                self.on_sweep_due()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None when unknown, evicted, expired or deleted."""
        path = self._path(response_id)
        if path is None:
            return None
        try:
            with path.open("rb") as f:
                created = os.fstat(f.fileno()).st_mtime
                data = f.read()
        except FileNotFoundError:
            return None
        if created + self.ttl < self._clock():
            return None
        return msgspec.json.decode(data, type=StoredResponse)

    def delete(self, response_id: str) -> bool:
        """Delete the record (and a cancel marker). False when there was none."""
        path = self._path(response_id)
        if path is None:
            return False
        marker = self._path(response_id, ".cancel")
        assert marker is not None
        marker.unlink(missing_ok=True)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def request_cancel(self, response_id: str) -> None:
        """Leave the cancel marker for the process that runs ``response_id``."""
        marker = self._path(response_id, ".cancel")
        assert marker is not None, response_id
        marker.touch()

    def cancel_requested(self, response_id: str) -> bool:
        marker = self._path(response_id, ".cancel")
        return marker is not None and marker.exists()

    def sweep(self) -> None:
        """Delete the expired records, then the oldest, until the rest fit the budget.
        Blocking (a directory listing: about 20 ms for 5,000 records on ``/dev/shm``);
        safe in a worker thread while the event loop reads and writes records."""
        now = self._clock()
        entries = []
        for entry in _scan(self.directory):
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            if stat.st_mtime + self.ttl < now:
                self._remove(entry.name)
            else:
                entries.append((stat.st_mtime, entry.name, stat.st_size))
        total = sum(size for _, _, size in entries)
        for _, name, size in sorted(entries):
            if total <= self.max_bytes:
                break
            self._remove(name)
            total -= size

    def _remove(self, name: str) -> None:
        self.delete(name.removesuffix(".json"))

    def used_bytes(self) -> int:
        """The bytes the records hold now (a directory listing)."""
        total = 0
        for entry in _scan(self.directory):
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat().st_size
        return total


def _scan(directory: Path) -> Iterator[os.DirEntry[str]]:
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.endswith(".json") and not entry.name.startswith("."):
                yield entry


@contextlib.contextmanager
def responses_store_dir(given: str | None) -> Iterator[str]:
    """The directory every API process of a server shares: ``given`` (kept), else a
    private one (mode 0700) on ``/dev/shm`` where it exists, removed on exit."""
    if given is not None:
        yield given
        return
    memory = Path("/dev/shm")
    parent = memory if memory.is_dir() and os.access(memory, os.W_OK) else None
    path = tempfile.mkdtemp(prefix="tserve-responses-", dir=parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

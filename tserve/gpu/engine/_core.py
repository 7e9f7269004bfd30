"""What the engine process's loop drives: the :class:`Core` protocol and the
bookkeeping every core shares (:class:`CoreBookkeeping`: counters, pending
outputs, aborts, ``ready_info``, the fault hook; :class:`PeerKeyedBookkeeping`
adds the live-request table of the cores without a scheduler), and the
tokenizer files that answer a Hello from another host
(:func:`tokenizer_bundle`). No torch.

A core is the step loop of one engine kind, in process and without sockets:
``_engine_core.py`` (generation), ``_embed_core.py`` (embeddings) and
``_echo_core.py`` (a model-free stand-in that measures the frontend alone).
``_process.py`` drives any of them the same way: ``add`` and ``abort`` as
frames arrive, ``step`` while ``has_work``, ``stats`` with every frame out.

Rules every core keeps (the shared parts live in :class:`CoreBookkeeping`):

* A request is live from ``add`` until its final output is returned by
  ``step``; it belongs to the peer (API process) that added it.
* An add whose id is already live for the SAME peer is that peer's protocol
  violation: logged and dropped, because an error output would end the live
  request's stream while it goes on.
* Aborts are idempotent: unknown or finished ids are ignored; every id
  received counts in ``EngineStats.aborts_received``. With a peer, only that
  peer's requests are touched (another API process may use the same id).
  An aborted request's final ``FinishReason.ABORT`` output goes out with the
  next step.
* Outputs decided outside a step (rejections, aborts) wait in one list and go
  out first in the next ``step``.

Test-only fault injection: when the environment variable
``TSERVE_TEST_FAULT_FORWARD`` holds a number N when a core is built, its N-th
step that runs the model (counting from 1) raises :class:`ForwardFault`
instead, so tests can show that a fatal error reaches every API process as
``EngineDead``. It is unset in production and nothing that arrives over HTTP
or the wire can set it.

A second hook, ``TSERVE_TEST_FAULT_STALL`` = ``N:MODE:DIR``, holds the N-th
step that runs the model inside the step, after creating ``DIR/held``: with
MODE ``progress`` the held step keeps advancing :meth:`Core.progress` until
``DIR/release`` exists (a long step that works); with MODE ``wedge`` it never
returns and never progresses (a kernel that never returns). Tests use it to
show what ``_pulse.py`` promises.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Final, Generic, Protocol, TypeVar

from tserve.protocol import (
    CHAT_TEMPLATES_DIR,
    TOKENIZER_FILES,
    AddRequest,
    EngineConfig,
    EngineReady,
    EngineStats,
    FinishReason,
    RequestOutput,
    SamplingDefaults,
    TokenizerBundle,
    tokenizer_file_allowed,
)

__all__ = [
    "FORWARD_FAULT_ENV",
    "STALL_FAULT_ENV",
    "Core",
    "CoreBookkeeping",
    "ForwardFault",
    "LiveRequest",
    "PeerKeyedBookkeeping",
    "PeerOutput",
    "tokenizer_bundle",
]

log = logging.getLogger(__name__)

FORWARD_FAULT_ENV: Final = "TSERVE_TEST_FAULT_FORWARD"
STALL_FAULT_ENV: Final = "TSERVE_TEST_FAULT_STALL"

PeerOutput = tuple[bytes, RequestOutput]
"""An output and the peer (API process) it goes to."""


class ForwardFault(RuntimeError):
    """Raised on purpose by the test-only forward-pass fault hook."""


class Core(Protocol):
    """One engine kind's step loop, as ``_process.py`` drives it. Not thread-safe."""

    def add(self, request: AddRequest, peer: bytes) -> None:
        """Queue a request; one that can never run is answered with an error. Never blocks."""

    def abort(self, request_ids: Iterable[str], peer: bytes | None = None) -> None:
        """End live requests with ABORT (idempotent; with ``peer``, only its own)."""

    def abort_peer(self, peer: bytes) -> None:
        """Abort every request of an API process that is gone."""

    def abort_all(self) -> None:
        """Abort every live request (shutdown)."""

    @property
    def has_work(self) -> bool:
        """True while a step would do something (live requests or pending outputs)."""

    def step(self, now: float | None = None) -> list[PeerOutput]:
        """One step: at most one output per request. Blocks for one step's work.

        ``now`` (default ``time.time()``) is what deadlines are checked
        against. Raises only for a failure of the whole step (fatal).
        """

    def stats(self) -> EngineStats:
        """A snapshot of the load, sent with every frame."""

    def progress(self) -> int:
        """A counter that grows while a step works: once as a step that runs the
        model begins, and with each layer its forward pass finishes. Safe to read
        from another thread while ``step`` runs (``_pulse.py``)."""

    def ready_info(self) -> EngineReady:
        """What an API process learns in answer to its Hello."""

    def prepare_grammars(self) -> None:
        """Build what structured outputs need now, not at the first constrained
        request (``Hello(grammars=True)``). Blocks while it builds; idempotent;
        a core that serves no grammars does nothing."""

    def close(self) -> None:
        """Stop the core's own threads (the engine is exiting); does not block."""


class LiveRequest(Protocol):
    """What the shared bookkeeping reads of a core's record of one live request."""

    @property
    def request_id(self) -> str: ...

    @property
    def peer(self) -> bytes: ...

    @property
    def deadline(self) -> float | None: ...


R = TypeVar("R", bound=LiveRequest)


class CoreBookkeeping(abc.ABC, Generic[R]):
    """Counters, pending outputs, the abort fan-out and the fault hook of a core.

    A core subclasses it with its own record type ``R`` and says how to find
    live records (:meth:`_matching`, :meth:`_live`) and how to end them
    (:meth:`_end_aborted`); the rules in the module docstring follow. It
    also sets the attributes below, which :meth:`ready_info` reports.
    """

    # Set by each core's __init__.
    model_name: str
    model_path: Path
    max_model_len: int  # the longest prompt + output (embeddings: input)
    vocab_size: int
    config: EngineConfig
    device: object  # reported as str()
    # Class defaults a core may override.
    eos_token_ids: Collection[int] = ()
    sampling_defaults = SamplingDefaults()
    task = "generate"
    embedding_dim = 0

    def __init__(self) -> None:
        # Outputs decided outside a step, sent first with the next one.
        # Bound: the requests added or aborted since the previous step.
        self._pending: list[PeerOutput] = []
        self._steps = 0
        self._aborts_received = 0
        self._fault_step = _fault_step_from_env()
        self._stall = _Stall.from_env()
        self._stall_progress = 0  # what a held step (the stall hook) counted

    # -- what a core provides -------------------------------------------------------

    @abc.abstractmethod
    def _matching(self, request_id: str, peer: bytes | None) -> list[R]:
        """The live records with ``request_id`` (only ``peer``'s, when given)."""

    @abc.abstractmethod
    def _live(self) -> Iterable[R]:
        """Every live record."""

    @abc.abstractmethod
    def _end_aborted(self, records: list[R]) -> None:
        """End ``records`` (all live) with ABORT, free what they hold, and report them."""

    # -- shared ------------------------------------------------------------------

    def abort(self, request_ids: Iterable[str], peer: bytes | None = None) -> None:
        """Idempotent: unknown or finished ids are ignored. With ``peer``, only its requests."""
        for request_id in request_ids:
            self._aborts_received += 1
            found = self._matching(request_id, peer)
            if found:
                self._end_aborted(found)

    def abort_peer(self, peer: bytes) -> None:
        """Abort every request of an API process that is gone."""
        self._end_aborted([r for r in self._live() if r.peer == peer])

    def abort_all(self) -> None:
        """Abort every live request (shutdown); the outputs go out with the next step."""
        self._end_aborted(list(self._live()))

    def close(self) -> None:
        """No threads of its own (a core that has some overrides this)."""

    def progress(self) -> int:
        """Steps that ran the model (a core whose forward pass counts its layers adds them)."""
        return self._steps + self._stall_progress

    def ready_info(self) -> EngineReady:
        """What an API process learns in answer to its Hello."""
        return EngineReady(
            model=self.model_name,
            model_path=str(self.model_path),
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids),
            max_num_seqs=self.config.max_num_seqs,
            kv_tokens_total=self._kv_tokens_total(),
            device=str(self.device),
            pid=os.getpid(),
            task=self.task,
            embedding_dim=self.embedding_dim,
            kv_block_size=self._kv_block_size(),
            sampling_defaults=self.sampling_defaults,
        )

    def prepare_grammars(self) -> None:
        """Nothing: a core serves no grammars unless it says otherwise (EngineCore)."""

    def _kv_tokens_total(self) -> int:
        """The KV budget in tokens; none unless a core keeps a KV cache."""
        return 0

    def _kv_block_size(self) -> int:
        """Tokens in one KV block; none unless a core keeps a KV cache."""
        return 0

    def _is_duplicate(self, request_id: str, peer: bytes) -> bool:
        """True (and logged) when ``peer`` re-uses one of its live ids: drop the add."""
        if not self._matching(request_id, peer):
            return False
        log.error("peer %r re-used the live request id %r; add ignored", peer, request_id)
        return True

    def _reject(self, peer: bytes, request_id: str, problem: str, param: str | None = None) -> None:
        """Answer a request that can never run with one ERROR output (next step);
        ``param`` names the part of the request at fault, if one is."""
        output = RequestOutput(request_id, [], FinishReason.ERROR, error=problem, error_param=param)
        self._pending.append((peer, output))

    def _report(self, peer: bytes, output: RequestOutput) -> None:
        """Send ``output`` with the next step."""
        self._pending.append((peer, output))

    def _take_pending(self) -> list[PeerOutput]:
        outputs, self._pending = self._pending, []
        return outputs

    def _count_step(self) -> None:
        """Count a step that runs the model; the test-only fault hook fires here."""
        self._steps += 1
        if self._steps == self._fault_step:
            raise ForwardFault(f"injected forward fault at step {self._steps}")
        if self._stall is not None and self._steps == self._stall.step:
            self._stall.hold(self._count_stalled)

    def _count_stalled(self) -> None:
        self._stall_progress += 1


class PeerKeyedBookkeeping(CoreBookkeeping[R]):
    """For a core that keeps its live requests in one dict by (peer, id), first
    come first served, and ends an aborted or expired one with an empty ABORT
    output."""

    def __init__(self) -> None:
        super().__init__()
        # Live requests, in arrival order; keyed by peer too, because two API
        # processes may use the same id. Bound: the requests the API
        # processes have live (their admission caps them).
        self._requests: dict[tuple[bytes, str], R] = {}

    @property
    def has_work(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def _matching(self, request_id: str, peer: bytes | None) -> list[R]:
        if peer is not None:
            found = self._requests.get((peer, request_id))
            return [] if found is None else [found]
        return [r for r in self._requests.values() if r.request_id == request_id]

    def _live(self) -> Iterable[R]:
        return self._requests.values()

    def _end_aborted(self, records: list[R]) -> None:
        for r in records:
            del self._requests[(r.peer, r.request_id)]
            self._report(r.peer, RequestOutput(r.request_id, [], FinishReason.ABORT))

    def _expire(self, now: float) -> None:
        """End every request whose deadline is before ``now`` with ABORT."""
        self._end_aborted(
            [r for r in self._requests.values() if r.deadline is not None and r.deadline < now]
        )


def tokenizer_bundle(directory: Path) -> TokenizerBundle:
    """The tokenizer files ``directory`` (the model a core loaded) has, for an API
    process on another host (``Hello(tokenizer=True)``). Blocking file IO: a
    few MB, once per API process."""
    names = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    templates = directory / CHAT_TEMPLATES_DIR
    if templates.is_dir():
        names += [f"{CHAT_TEMPLATES_DIR}/{path.name}" for path in sorted(templates.glob("*.jinja"))]
    allowed = (name for name in names if tokenizer_file_allowed(name))
    return TokenizerBundle({name: (directory / name).read_bytes() for name in allowed})


class _Stall:
    """The test-only stall hook (module docstring): which step, how, and where."""

    POLL = 0.01  # s between looks at DIR/release; progress moves this often

    def __init__(self, step: int, mode: str, directory: Path) -> None:
        self.step, self.mode, self.directory = step, mode, directory

    @classmethod
    def from_env(cls) -> _Stall | None:
        value = os.environ.get(STALL_FAULT_ENV)
        if not value:
            return None
        step, mode, directory = value.split(":", 2)
        if mode not in ("progress", "wedge"):
            raise ValueError(f"{STALL_FAULT_ENV}: mode must be progress or wedge, got {mode!r}")
        return cls(int(step), mode, Path(directory))

    def hold(self, progressed: Callable[[], None]) -> None:
        """Block the step as the mode says; ``progressed`` counts its progress."""
        (self.directory / "held").touch()
        if self.mode == "wedge":
            threading.Event().wait()  # never set: a call that never returns
        while not (self.directory / "release").exists():
            time.sleep(self.POLL)
            progressed()


def _fault_step_from_env() -> int | None:
    """The step number of the test-only forward fault, or None (production)."""
    value = os.environ.get(FORWARD_FAULT_ENV)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{FORWARD_FAULT_ENV} must be a step number, got {value!r}") from None

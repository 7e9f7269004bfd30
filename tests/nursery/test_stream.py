"""RequestStream's cancel and abort paths against the fake engine (tests/mux/fake_engine.py).

No model and no torch: the fake engine speaks the real protocol, and the
stream gets a real mux through a :class:`RequestSeam`. Token ``i`` is
``chr(i)``; a prompt ``[ord("A")]`` streams "ABCD...".
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest

from tests.guards import HANG_GUARD
from tests.mux.fake_engine import run_fake_engine
from tests.nursery.conftest import eventually
from tserve.mux import EngineDeadError, Mux, open_mux
from tserve.nursery import RequestState, RequestStream, RequestTimeout
from tserve.nursery._admission import Admission
from tserve.nursery._request import RequestSeam, loop_caller
from tserve.protocol import Constraint, SamplingParams

pytestmark = pytest.mark.anyio

LONG = SamplingParams(max_tokens=200)  # far more steps than any test reads


class CountingAdmission(Admission):
    """An admission that counts how often a unit left it (once per stream)."""

    def __init__(self) -> None:
        super().__init__(max_pending=1000)
        self.left = 0

    def leave(self, count: int = 1, *, held: bool) -> None:
        self.left += 1
        super().leave(count, held=held)


async def _no_constraint_check(constraint: Constraint) -> None:
    """These tests send no constraints."""


class Client:
    """The admitting side of a seam: counts releases (one per stream)."""

    def __init__(self, mux: Mux) -> None:
        self.mux = mux
        self.admission = CountingAdmission()
        self.seam = RequestSeam(
            mux,
            lambda ids: "".join(map(chr, ids)),
            lambda prompt, params: None,
            _no_constraint_check,
            self.admission,
            loop_caller(),
            contextlib.nullcontext,
        )
        self._ids = 0

    @property
    def released(self) -> int:
        return self.admission.left

    def stream(self, params: SamplingParams, timeout: float | None = None) -> RequestStream:
        self._ids += 1
        held = self.admission.enter()
        rid = f"req-{self._ids}"
        return RequestStream(self.seam, rid, [ord("A")], params, timeout, holds_slot=held)

    async def ended(self, stream: RequestStream, state: RequestState, *, aborts: int) -> None:
        """``stream`` ended in ``state``, released its slot once, and sent ``aborts`` aborts."""
        assert stream.state is state
        assert self.released == 1
        await self.settled(aborts)

    async def settled(self, aborts: int) -> None:
        """The fake engine runs nothing and has received exactly ``aborts`` aborts."""
        mux = self.mux

        def idle() -> bool:
            stats = mux.engine_stats
            return stats.running == 0 and stats.aborts_received == mux.stats.aborts_sent

        await eventually(idle, "the fake engine settles")
        assert mux.stats.aborts_sent == aborts
        assert mux.open_mailboxes == 0


@pytest.fixture
async def client(ipc_address: str) -> AsyncIterator[Client]:
    with run_fake_engine(ipc_address, step_delay=0.005), anyio.fail_after(HANG_GUARD):
        async with open_mux(ipc_address, ready_timeout=30) as mux:
            yield Client(mux)


async def test_to_the_end_sends_no_abort(client: Client) -> None:
    async with client.stream(SamplingParams(max_tokens=5)) as stream:
        text = "".join([delta.text async for delta in stream])
    assert text == "ABCDE"
    await client.ended(stream, RequestState.FINISHED, aborts=0)


async def test_a_cancel_mid_stream_aborts_once(client: Client) -> None:
    stream = client.stream(LONG)
    with anyio.CancelScope() as scope:
        async for _ in stream:
            scope.cancel()
    await client.ended(stream, RequestState.ABORTED, aborts=1)
    stream.close()  # idempotent
    assert client.released == 1


async def test_break_and_close_abort_once(client: Client) -> None:
    async with client.stream(LONG) as stream:
        async for _ in stream:
            break
    await client.ended(stream, RequestState.ABORTED, aborts=1)


async def test_a_stop_string_aborts_the_running_request(client: Client) -> None:
    stream = client.stream(SamplingParams(max_tokens=200, stop=("D",)))
    deltas = [delta async for delta in stream]
    assert "".join(d.text for d in deltas) == "ABC"
    assert deltas[-1].finish_reason == "stop"
    await client.ended(stream, RequestState.ABORTED, aborts=1)


async def test_our_deadline_times_out_with_one_abort(client: Client) -> None:
    stream = client.stream(LONG, timeout=0.05)
    with pytest.raises(RequestTimeout):
        async for _ in stream:
            pass
    await client.ended(stream, RequestState.ABORTED, aborts=1)


async def test_a_stream_never_read_is_closed_without_an_abort(client: Client) -> None:
    stream = client.stream(LONG)
    stream.close()
    assert stream.state is RequestState.CLOSED
    assert client.released == 1
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    await client.settled(aborts=0)


async def test_engine_death_fails_the_stream_without_an_abort(ipc_address: str) -> None:
    with (
        run_fake_engine(ipc_address, die_after_steps=3, send_dead=True),
        anyio.fail_after(HANG_GUARD),
    ):
        async with open_mux(ipc_address, ready_timeout=30) as mux:
            client = Client(mux)
            stream = client.stream(LONG)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert stream.state is RequestState.FAILED
            assert client.released == 1
            assert mux.stats.aborts_sent == 0

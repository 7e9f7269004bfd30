"""Either engine's death reaches every live stream as an error event, over real HTTP.

A real server of the tiny model with the embedding engine; 50 live streams;
kill -9 of one engine. The time from the kill to the last stream's error
event is printed (``pytest -s``; ``python -m benchmarks.engine_death``
reports it too): a hang guard bounds it here, never a timing assertion.
"""

from __future__ import annotations

import pytest

from benchmarks.engine_death import engine_pids, measure_engine_death
from tests.markers import needs_embedding_model
from tests.web.test_faults import StartServer

pytestmark = [
    pytest.mark.slow,
    needs_embedding_model,
]

STREAMS = 50


@pytest.mark.parametrize("engine", ["generation", "embedding"])
def test_an_engine_kill_ends_every_live_stream_with_an_error_event(
    start_server: StartServer, engine: str
) -> None:
    server = start_server("--embedding-model", "default", "--max-num-seqs", "64")
    pids = engine_pids(server.process.pid)
    timing = measure_engine_death(server.url, engine, pids, streams=STREAMS)
    print(timing.report())
    assert timing.endings == ["error:engine_dead"] * STREAMS
    assert server.client.get("/health").status_code == 503
    assert server.process.wait(60) != 0

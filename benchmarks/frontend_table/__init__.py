"""The frontend's ceiling as one table: embedded and over HTTP, 1 and 2 API processes.

Run: ``python -m benchmarks.frontend_table [--lengths 8 256] [--requests 10000 3000]
[--concurrency 256] [--step-time 0.001] [--repeat 2]``

No model runs: the engine is the echo engine (``--engine-kind echo``), which
gives each running request one token per ``--step-time`` seconds, so what is
measured is the frontend alone. For each output length in ``--lengths``
(``--requests`` requests of it, ``--concurrency`` in flight at once, each
finishing after exactly that many tokens) four rows are measured
(:mod:`._measure`):

* **raw**: the echo engine's own rate: an ``EchoCore`` stepped in this
  process, fed a new request whenever one ends; no API, no socket, no text;
* **embedded**: ``open_llm`` with its default admission on the echo engine,
  ``--concurrency`` tasks in this process each calling ``generate`` with a
  text prompt and reading its deltas, one request after another;
* **HTTP, 1 and 2 API processes**: ``python -m tserve serve --engine-kind
  echo`` at its defaults otherwise (``--api-processes 2`` for the second,
  :mod:`._server`), driven by ``--concurrency`` keep-alive connections
  of ``tserve.bench``'s client in a child process (:mod:`._client`), each
  sending streamed completions one after another.

The echo engine runs ``--concurrency`` requests a step, so its rate is far
above what the frontend reaches. Each row has requests/s and streamed
tokens/s (whole and per API process), the CPU seconds every process used
(API process or processes, engine, client) and its wall time; ratios where
one fits (:mod:`._table`): each row's tokens/s ÷ the raw row's, and 2 API
processes ÷ 1. Streamed tokens are counted, not deltas: when a reader falls
behind the engine its mailbox merges deltas, so one delta (one SSE event)
may carry several tokens. ``--repeat R`` measures every row R times, alternating, and
keeps each row's fastest run.

The table is printed (Markdown) and written with every run's figures to
``results/frontend_table-<time>.json``, with a bar chart beside it
(``.png``) when matplotlib is installed. The exit status is 0 only if every
request of every run ended with exactly its tokens.
"""

"""The seed failure over HTTP: thousands of streaming completions at a fixed rate.

Run: ``python -m benchmarks.seed_http [--requests 10000] [--rate 1000] [--max-tokens 8]
[--model tiny|default|PATH] [--engine-kind model|echo] [--server-defaults] [--max-seconds 600]``

Frontends that open one ZMQ socket per request died at about 1,000 in-flight
requests (``zmq.MAX_SOCKETS``, the fd limit, then 500s). This benchmark
recreates that load against a real ``python -m tserve serve`` and checks the
two things tserve promises: no request fails, and the number of ZMQ sockets
between the API process and the engine stays constant while fds grow only
with HTTP connections.

Three processes, all on loopback:

* the **server**, ``python -m tserve serve`` (its API process plus its engine
  child), started with ``--port 0`` and a ``--max-pending`` above
  ``--requests`` so that admission control refuses none of them, or with
  ``--server-defaults`` at its own defaults for everything but the port
  (admission, engine, request log, embedding model: ``make serve``'s
  server) (:mod:`._server`);
* the **load generator**, ``--clients`` child processes (2 by default) so
  that it shares no event loop with this process and no process needs an fd
  per stream for all of them (:mod:`._load`): open-loop arrivals at
  ``--rate`` requests/s in all (a fixed or Poisson schedule, each process
  taking every ``--clients``-th request), one TCP connection per request
  from one of 16 loopback source addresses, raw HTTP/1.1 on one ``epoll``
  per process (it opens 5,000 connections/s on 2 shared cores). Each
  request streams ``--max-tokens`` tokens with ``ignore_eos`` and
  ``stream_options.include_usage``; the client reads the response to the end
  of its chunked body and records its status, token count and error kind
  (:mod:`._outcome`, on ``tserve.bench``'s HTTP and SSE parsers: every event,
  ``[DONE]`` last, the usage chunk's count);
* **this process**, the sampler (:mod:`._sampler`): every ``--interval``
  seconds it counts the server's fds (``/proc/PID/fd``) and the engine's
  accepted connections on its ``ipc://`` path (``/proc/PID/net/unix``),
  reads the API process's resident memory, and scrapes ``/metrics`` (live
  requests, requests and prompt tokens queued for a slot, HTTP generations
  in flight, engine running and waiting); about once a second it also classifies every server
  fd (TCP, unix, eventfd, ...) and counts the API-side ZMQ sockets exactly:
  the server's unix sockets whose peer is one of the engine's sockets on the
  ipc path (peer inodes from ``ss -x``) (:mod:`._census`).

The run is bounded (:mod:`._run`): a finite number of requests and a hard
``--max-seconds`` cap on the whole run, after which unfinished requests count
as errors (``unfinished``). At the end the server gets SIGTERM (SIGKILL past
a grace period), its engine is checked gone, and the result
(:mod:`._summary`) is printed and written to ``results/seed_http-<time>.json``
(and a timeline PNG when matplotlib is installed; :mod:`._report`). The exit
status is 0 only if every request was a 200 with exactly ``--max-tokens``
completion tokens, the ZMQ socket count never changed, and the API process's
memory grew by no more than the bound docs/configuration.md's "Admission" states for the
queue the server logged at start (``--max-queued`` requests at
``WAITING_REQUEST_BYTES`` each, ``--max-queued-tokens`` at 40 bytes each).

The package imports nothing, so that the load generator's process
(``python -m benchmarks.seed_http._load``) loads only what it uses; the
command line is :func:`._cli.main`.
"""

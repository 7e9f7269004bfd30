"""The OpenAI-compatible HTTP server: a thin quart-trio layer over :class:`tserve.LLM`.

What each module owns:

* ``_app``: :class:`AppConfig`, :class:`Frontend` (the handlers and live
  work of one app) with the route table, and :func:`create_app`.
* ``_routing``: how a request reaches its handler: the browser checks, the
  API key check, ``X-Request-Id``, errors mapped to replies, one record per
  request.
* ``_browser``: browser safety (sans-IO): 415 for a POST that is not JSON,
  403 for a ``Host`` not served (DNS rebinding), ``--allowed-hosts``.
* ``_generation``: ``/v1/completions`` and ``/v1/chat/completions``, and
  ``run_chat``, the chat path every chat-shaped API runs with its ``Output``.
* ``_messages``: Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens``
  on ``run_chat``; ``_message_bodies`` its Structs, ``_message_requests`` its
  bodies to chat requests, ``_message_events`` deltas to its blocks and SSE
  events (sans-IO).
* ``_responses_api``: OpenAI's ``/v1/responses`` (create, retrieve, delete,
  input items, cancel, background runs) on ``run_chat``;
  ``_response_bodies`` its Structs, ``_response_requests`` its bodies to chat
  requests, ``_response_events`` deltas to output items and SSE events
  (sans-IO), ``_response_store`` the stored responses every API process shares.
* ``_output_parser``: one output's deltas parsed into thinking and answer
  events (text, tool calls), what ``_message_events`` and ``_response_events``
  build on (sans-IO).
* ``_embeddings``: ``/v1/embeddings``.
* ``_tokens``: ``/tokenize`` and ``/detokenize``.
* ``_model_lookup``: the one lookup of a request's ``model`` (one LLM, or a
  registry's models loaded on demand), held for the whole request; the
  cached text of a token and the reasoning syntax, per engine.
* ``_models``: ``/v1/models``, ``/v1/models/{id}``, and llama.cpp's router
  admin routes ``/models``, ``/models/load``, ``/models/unload``.
* ``_probes``: ``/version``, ``/health``, ``/ready``, ``/metrics``.
* ``_openapi``: ``/openapi.json``, the OpenAPI description of every route
  (request bodies generated from ``_bodies``).
* ``_inflight``: the live requests the shutdown drain waits for and aborts.
* ``_streaming``: running a request's streams: collected into one body, or
  pumped into an SSE response body.
* ``_send_buffer``: the bytes a streaming response holds for its client, and
  their bounds (per response, per app).
* ``_sse``: the SSE encoder and the order of a stream's events (sans-IO).
* ``_bodies``: request bodies as clients send them (msgspec Structs) and
  their bounds.
* ``_requests`` / ``_responses``: OpenAI JSON to requests, and deltas to
  OpenAI JSON (sans-IO).
* ``_structured``: structured-output fields (``response_format``, vLLM's
  ``structured_outputs`` and ``guided_*``) and ``logit_bias`` as
  SamplingParams values (sans-IO).
* ``_reasoning``: a thinking model's ``<think>`` reasoning split from its
  answer delta by delta, the syntax a chat template uses, and a structured
  output's grammar put after the thinking (sans-IO).
* ``_tools``: ``tools`` and ``tool_choice``, and the plan for one model's
  template: what it renders, the enforcing grammar (sans-IO).
* ``_tool_formats``: the tool-call formats (Hermes, Llama 3 JSON, Mistral,
  generic), detecting one from a template, its grammar, parsing a whole
  output; ``_tool_stream``: the streamed parser (sans-IO).
* ``_errors``: the one mapping of exceptions to error JSON (OpenAI's, and
  Anthropic's for the Messages routes).
* ``_metrics``: Prometheus metrics (vLLM's names for the model-server
  contract, summed over API processes) and the per-request log line.
* ``_stats_files``: each API process's live numbers as a file in the shared
  metrics directory, for the metrics process of ``--metrics-port``.
* ``_server``: :func:`serve`: the server's lifecycle (signals, the drain,
  engine death) around ``_connections``.
* ``_connections``: the HTTP connections: hypercorn's protocol over our own
  accept loop, every write bounded by ``--stall-timeout``.
* ``_accept``: the accept loop: every connection the kernel has ready at
  each wake-up, up to a bound on the connections held.
* ``_workers``: the extra API processes of ``--api-processes N`` and the
  metrics process of ``--metrics-port`` (main process side);
  ``_worker_main``: what runs inside one extra API process.
* ``_metrics_main``: what runs inside the metrics process;
  ``_metrics_http``: its ``GET /metrics`` over h11, from one trio thread.
"""

from tserve.web._app import AppConfig, Frontend, create_app
from tserve.web._server import ServerConfig, serve

__all__ = ["AppConfig", "Frontend", "ServerConfig", "create_app", "serve"]

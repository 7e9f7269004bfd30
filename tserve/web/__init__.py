"""The OpenAI-compatible HTTP server: a thin quart-trio layer over :class:`tserve.LLM`.

Request/response mapping, SSE and error mapping are sans-IO modules
(``_requests``, ``_responses``, ``_sse``, ``_errors``); ``_app`` holds the
routes and ``_server`` runs hypercorn's trio worker with graceful shutdown.
"""

from tserve.web._app import AppConfig, Frontend, create_app
from tserve.web._server import ServerConfig, serve

__all__ = ["AppConfig", "Frontend", "ServerConfig", "create_app", "serve"]

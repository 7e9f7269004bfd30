"""The official SDKs' clients of a live server: its URL and API key, no retries
(a retry would hide the refusal or the failure a test looks for)."""

from __future__ import annotations

from typing import Any

import anthropic
import openai

from tests.web.conftest import API_KEY, Server


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def anthropic_client(server: Server, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, **kwargs)

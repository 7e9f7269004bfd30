"""The OpenAPI description, sans-IO: it covers the route table exactly, and its
request schemas are the decoder's (a body the schema allows is one msgspec takes)."""

from __future__ import annotations

from typing import Any, cast

from tserve.nursery import LLM
from tserve.protocol import EngineReady
from tserve.web._app import AppConfig, Frontend
from tserve.web._openapi import OPERATIONS, openapi_document


class _NoEngine:
    """Enough of an LLM to build a Frontend's route table (nothing is called)."""

    model = "m"
    ready = EngineReady("m", "m", 8, 8, [0], 1, 16, "cpu", 0, kv_block_size=16)


def _routes() -> dict[tuple[str, str], bool]:
    frontend = Frontend(cast(LLM, _NoEngine()), AppConfig(served_model_names=("m",)))
    return {(r.method.lower(), r.path): r.protected for r in frontend.routes()}


def test_every_route_is_described_once_with_its_key_requirement() -> None:
    routes = _routes()
    assert set(OPERATIONS) == set(routes)
    for key, op in OPERATIONS.items():
        assert op.protected == routes[key], key


def test_the_document_names_its_bodies_errors_and_key() -> None:
    doc: dict[str, Any] = openapi_document(api_key=True)
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for name in ("CompletionBody", "ChatBody", "EmbeddingBody", "TokenizeBody", "DetokenizeBody"):
        assert schemas[name]["type"] == "object", name
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatBody"
    }
    assert {"200", "400", "401", "404", "413", "503"} <= set(chat["responses"])
    assert chat["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"
    }
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert doc["security"] == [{"bearer": []}, {"apiKey": []}]
    messages = doc["paths"]["/v1/messages"]["post"]
    assert messages["responses"]["529"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AnthropicError"
    }
    assert sorted(schemas["MessagesBody"]["required"]) == ["max_tokens", "messages", "model"]
    assert "security" not in openapi_document(api_key=False)
    responses = doc["paths"]["/v1/responses"]["post"]
    assert responses["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponsesBody"
    }
    items = doc["paths"]["/v1/responses/{response_id}/input_items"]["get"]
    assert [(p["name"], p["in"]) for p in items["parameters"]] == [
        ("response_id", "path"),
        ("order", "query"),
        ("limit", "query"),
        ("after", "query"),
    ]
    assert "404" in doc["paths"]["/v1/responses/{response_id}"]["delete"]["responses"]

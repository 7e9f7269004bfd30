"""schemathesis against the live server's own ``/openapi.json``: positive and negative
examples of every operation; no 5xx, and every response as the description says
(status, content type, body schema).

Driven through hypothesis directly (``APIOperation.as_strategy``), one test per
generation mode, so it needs no pytest plugin.
"""

from __future__ import annotations

from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.fuzz.conftest import REQUEST_TIMEOUT, assert_healthy
from tests.web.conftest import API_KEY, Server

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
EXAMPLES = 50  # per operation and mode


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_answers_as_described(fuzz_server: Server, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", timeout=30)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    calls = 0
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()  # type: ignore[union-attr]  # an Err (a bad schema) fails here
            if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
                continue  # nothing to corrupt: no GET takes parameters

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def call(case: schemathesis.Case[Any]) -> None:
                nonlocal calls
                calls += 1
                case.call_and_validate(
                    base_url=fuzz_server.url,
                    session=session,
                    headers=auth,
                    checks=CHECKS,
                    timeout=REQUEST_TIMEOUT,
                )

            call()
    assert calls > 0
    print(f"schemathesis {mode.value}: {calls} requests")
    assert_healthy(fuzz_server)

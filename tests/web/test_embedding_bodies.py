"""/v1/embeddings bodies in and out, without a server (sans-IO)."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest

from tserve.nursery import EmbeddingResult, InvalidRequest
from tserve.web._bodies import MAX_EMBEDDING_INPUTS
from tserve.web._requests import parse_embeddings
from tserve.web._responses import embedding_response


def parse(body: dict[str, Any]) -> Any:
    return parse_embeddings(json.dumps(body).encode())


def test_every_input_shape() -> None:
    assert parse({"input": "a"}).inputs == ["a"]
    assert parse({"input": ["a", "b"]}).inputs == ["a", "b"]
    assert parse({"input": [1, 2]}).inputs == [[1, 2]]
    assert parse({"input": [[1], [2, 3]]}).inputs == [[1], [2, 3]]
    req = parse({"input": "a", "model": "m", "dimensions": 384, "user": "u"})
    assert (req.model, req.encoding_format, req.dimensions) == ("m", "float", 384)
    assert parse({"input": "a", "encoding_format": "base64"}).encoding_format == "base64"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input[1]"),
        ({"input": []}, "input"),
        ({"input": [[1], []]}, "input[1]"),
        ({"input": ["a", 1]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [-1]}, "input[0]"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "input"),
    ],
)
def test_bad_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(body)
    assert info.value.param == param


def test_response_float_and_base64() -> None:
    vectors = [[1.0, -0.5, 0.25], [0.0, 1.0, 0.0]]
    raw = [struct.pack("<3f", *v) for v in vectors]
    result = EmbeddingResult(raw, 7, "m")
    floats = embedding_response("m", result, "float")
    assert floats == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": vectors[0]},
            {"object": "embedding", "index": 1, "embedding": vectors[1]},
        ],
        "model": "m",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
    b64 = embedding_response("m", result, "base64")
    assert [base64.b64decode(d["embedding"]) for d in b64["data"]] == raw

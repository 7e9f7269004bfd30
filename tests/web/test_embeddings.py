"""/v1/embeddings on a live server: the tiny generation model + all-MiniLM-L6-v2,
driven by the official openai SDK and httpx."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.markers import needs_embedding_model
from tests.web.conftest import API_KEY, Server, keyed_server

pytestmark = [
    pytest.mark.slow,
    needs_embedding_model,
]

MODEL = "all-MiniLM-L6-v2"
DIM = 384
PARAPHRASES = ["A man is eating food.", "A man is eating a piece of bread."]
UNRELATED = "The stock market fell sharply on Tuesday."


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("embed-server") / "server.log"
    with keyed_server(tiny_model_dir, "--embedding-model", "default", log=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


@pytest.fixture(autouse=True)
def nothing_left_in_flight(server: Server) -> Iterator[None]:
    yield
    server.wait_for_metric("tserve_http_generations_in_flight", 0)


def token_count(text: str) -> int:
    """MiniLM's tokens for ``text``, [CLS] and [SEP] included."""
    from tokenizers import Tokenizer

    from tserve.gpu.models._directory import default_embedding_model_dir

    tokenizer = Tokenizer.from_file(str(default_embedding_model_dir() / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return len(tokenizer.encode(text).ids)


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def unit_norm(v: list[float]) -> bool:
    return math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, abs_tol=1e-5)


def test_sdk_string_and_list_float_and_base64(client: openai.OpenAI) -> None:
    one = client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    assert one.object == "list" and one.model == MODEL and len(one.data) == 1
    assert one.data[0].object == "embedding" and one.data[0].index == 0
    assert len(one.data[0].embedding) == DIM and unit_norm(one.data[0].embedding)
    assert one.usage.prompt_tokens == one.usage.total_tokens == token_count("hello world")

    texts = [*PARAPHRASES, UNRELATED]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    # Not told a format, the SDK asks for base64 and decodes it itself.
    b64 = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in floats.data] == [d.index for d in b64.data] == [0, 1, 2]
    for f, b in zip(floats.data, b64.data, strict=True):
        # float32 -> JSON -> float32 is exact, so both formats agree bit for bit.
        assert struct.pack(f"<{DIM}f", *f.embedding) == struct.pack(f"<{DIM}f", *b.embedding)
    assert floats.usage.prompt_tokens == sum(token_count(t) for t in texts)


def test_base64_is_little_endian_float32(server: Server, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "input": ["hello world"], "encoding_format": "base64"}
    reply = server.client.post("/v1/embeddings", json=body).json()
    raw = base64.b64decode(reply["data"][0]["embedding"])
    assert len(raw) == 4 * DIM
    floats = client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    assert list(struct.unpack(f"<{DIM}f", raw)) == floats.data[0].embedding


def test_paraphrases_are_closer_than_unrelated_sentences(client: openai.OpenAI) -> None:
    out = client.embeddings.create(model=MODEL, input=[*PARAPHRASES, UNRELATED])
    a, b, c = (list(d.embedding) for d in out.data)
    assert cosine(a, b) > cosine(a, c) + 0.4, (cosine(a, b), cosine(a, c))


def test_token_id_input_matches_text_input(client: openai.OpenAI) -> None:
    text = client.embeddings.create(model=MODEL, input="hello", encoding_format="float")
    ids = client.embeddings.create(model=MODEL, input=[[101, 7592, 102]], encoding_format="float")
    assert ids.usage.prompt_tokens == 3
    assert ids.data[0].embedding == pytest.approx(text.data[0].embedding, abs=1e-6)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "word " * 300}, 400, "input"),
        ({"input": ""}, 400, "input"),
        ({"input": ["fine", ""]}, 400, "input[1]"),
        ({"input": []}, 400, "input"),
        ({"input": [[101, 30522, 102]]}, 400, "input"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "dimensions": 128}, 400, "dimensions"),
        ({"input": "x", "model": "tiny"}, 404, "model"),
        ({"model": MODEL}, 400, "input"),
    ],
    ids=[
        "too-long",
        "empty",
        "empty-item",
        "empty-list",
        "bad-id",
        "format",
        "dimensions",
        "not-embedding",
        "missing",
    ],
)
def test_bad_requests_name_the_field(
    server: Server, body: dict[str, Any], status: int, param: str
) -> None:
    reply = server.client.post("/v1/embeddings", json={"model": MODEL, **body})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_dimensions_equal_to_the_models_are_accepted(client: openai.OpenAI) -> None:
    out = client.embeddings.create(model=MODEL, input="x", dimensions=DIM)
    assert len(out.data[0].embedding) == DIM


def test_models_lists_both_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny", MODEL]


def test_concurrent_embeddings_and_generations(server: Server, client: openai.OpenAI) -> None:
    inputs = [f"sentence number {i} about {topic}" for i, topic in enumerate("abcdefgh")]
    alone = [
        client.embeddings.create(model=MODEL, input=t, encoding_format="float") for t in inputs
    ]
    before = server.metric("tserve_embedding_inputs_total")

    def embed(text: str) -> list[float]:
        return (
            client.embeddings.create(model=MODEL, input=text, encoding_format="float")
            .data[0]
            .embedding
        )

    def generate(i: int) -> str | None:
        out = client.completions.create(
            model="tiny", prompt=f"hello {i}", max_tokens=8, extra_body={"ignore_eos": True}
        )
        return out.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        embedded = pool.map(embed, inputs)
        generated = pool.map(generate, range(8))
        vectors, reasons = list(embedded), list(generated)
    assert reasons == ["length"] * 8
    for vector, reference in zip(vectors, alone, strict=True):
        # Batched with others or alone: the same vector, up to float noise.
        assert vector == pytest.approx(reference.data[0].embedding, abs=1e-5)
    assert server.metric("tserve_embedding_inputs_total") == before + len(inputs)

